"""What a client may say about its deadline (handlers/edge/stages.client_deadline): milliseconds from
when the handler sees the request, or a wall-clock instant that counts TorchServe's queue too."""
import pytest

from tsbatch.handlers.core.errors import BadInput
from tsbatch.handlers.edge.stages import client_deadline

pytestmark = pytest.mark.unit


def test_no_header_asks_for_nothing():
    assert client_deadline({}, now=50.0) is None


def test_milliseconds_count_from_now_and_an_instant_from_the_wall_clock():
    assert client_deadline({"x-deadline-ms": "250"}, now=50.0) == pytest.approx(50.25)
    # the instant is 0.4 s after the wall clock's now: 0.4 s after the monotonic now
    assert client_deadline({"x-deadline-at": "1764662400.4"}, now=50.0, wall=1764662400.0) == pytest.approx(50.4)
    # already past (the request waited in TorchServe's queue): a deadline before now
    assert client_deadline({"x-deadline-at": b"1764662399.0"}, now=50.0, wall=1764662400.0) == pytest.approx(49.0)


def test_both_headers_the_earlier_wins():
    both = {"x-deadline-ms": "1000", "x-deadline-at": "1764662400.2"}
    assert client_deadline(both, now=50.0, wall=1764662400.0) == pytest.approx(50.2)
    both["x-deadline-ms"] = "100"
    assert client_deadline(both, now=50.0, wall=1764662400.0) == pytest.approx(50.1)


@pytest.mark.parametrize("headers, named", [({"x-deadline-ms": "soon"}, "X-Deadline-Ms"),
                                            ({"x-deadline-ms": "0"}, "X-Deadline-Ms"),
                                            ({"x-deadline-at": "tomorrow"}, "X-Deadline-At"),
                                            ({"x-deadline-at": "-5"}, "X-Deadline-At"),
                                            ({"x-deadline-at": "nan"}, "X-Deadline-At"),
                                            ({"x-deadline-at": "inf"}, "X-Deadline-At")])
def test_a_bad_deadline_is_bad_input_naming_its_header(headers, named):
    with pytest.raises(BadInput, match=named):
        client_deadline(headers, now=50.0, wall=1764662400.0)
