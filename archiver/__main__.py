from tsbatch.archiver.cli import main

raise SystemExit(main())
