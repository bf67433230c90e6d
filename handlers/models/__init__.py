"""The built-in models: the Hugging Face encoder (its .mar entry file too) and the generation runner."""
