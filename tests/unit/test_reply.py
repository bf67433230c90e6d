"""tsbatch.handlers.core.reply: a request's Reply is settled once (its texts' answers, or a forced 504),
and its done-callbacks run without any lock of the Reply held.

Threads here wait on Events with a bound (WAIT seconds) and go on as soon as the event is set.
"""
from __future__ import annotations

import threading

import pytest

from tsbatch.handlers.core.buckets import Item
from tsbatch.handlers.core.errors import DeadlineExceeded
from tsbatch.handlers.core.reply import Answer, Reply

pytestmark = pytest.mark.unit

WAIT = 10.0
LATE = Answer(DeadlineExceeded("waited too long"), 0)


def test_a_reply_is_settled_once_and_later_answers_of_its_texts_are_dropped():
    reply = Reply(2)
    assert not reply.settle(0, Answer({"r": 0}))
    assert not reply.done()
    assert reply.settle(1, Answer({"r": 1}))
    assert reply.done() and reply.answer().outcome == [{"r": 0}, {"r": 1}]
    assert not reply.settle(1, Answer({"r": "again"}))  # already complete: not completed a second time
    assert reply.answer().outcome == [{"r": 0}, {"r": 1}]
    one = Reply()
    assert one.settle(0, Answer({"r": 9})) and not one.settle(0, Answer({"r": 10}))
    assert one.answer().outcome == {"r": 9}


def test_forcing_a_reply_that_is_done_changes_nothing():
    reply = Reply(0)
    reply.settle(0, Answer({"r": 1}, 3, 16))
    reply.force(LATE)
    assert reply.answer() == Answer({"r": 1}, 3, 16)


def test_a_text_answered_after_the_reply_was_forced_is_dropped():
    reply = Reply(2)
    reply.settle(0, Answer({"r": 0}))
    reply.force(LATE)
    assert reply.done() and reply.answer() is LATE
    assert not reply.settle(1, Answer({"r": 1}))
    reply.force(Answer(DeadlineExceeded("a second time"), 0))
    assert reply.answer() is LATE


def test_on_done_runs_at_once_in_the_calling_thread_when_the_reply_is_already_done():
    reply = Reply()
    reply.settle(0, Answer({"r": 1}))
    ran = []
    reply.on_done(lambda: ran.append(threading.current_thread()))
    assert ran == [threading.current_thread()]


def test_on_done_runs_once_when_the_last_text_is_answered():
    reply = Reply(2)
    ran = []
    reply.on_done(lambda: ran.append(reply.answer().outcome))
    reply.settle(1, Answer({"r": 1}))
    assert ran == []
    reply.settle(0, Answer({"r": 0}))
    reply.force(LATE)
    reply.settle(0, Answer({"r": "again"}))
    assert ran == [[{"r": 0}, {"r": 1}]]


def test_reply_of_a_requests_items_takes_its_parts_envelope_and_deadline():
    items = [Item(0, "a", 1, 4, None, part, 2, "kserve_v1") for part in range(2)]
    reply = Reply.of(items, deadline=7.5)
    assert (reply.parts, reply.envelope, reply.deadline) == (2, "kserve_v1", 7.5)
    reply.settle(1, Answer({"r": 1}, 1, 4))
    assert reply.settle(0, Answer({"r": 0}, 1, 4))
    assert reply.answer().envelope == "kserve_v1" and len(reply.answer().parts) == 2


def test_a_done_callback_that_takes_the_waiters_lock_does_not_deadlock_with_a_forcing_waiter():
    """A waiter (continuous mode) forces its reply while holding its own lock; the lane thread
    settling the same reply runs the done-callback, which takes that lock. The callback must run
    with no lock of the Reply held, or each thread would wait for the other's lock."""
    waiter = threading.Lock()
    reply = Reply()
    holding, called = threading.Event(), threading.Event()
    got_lock, forced = [], threading.Event()

    def callback():
        called.set()
        got = waiter.acquire(timeout=WAIT)  # bounded: a deadlock shows as a failed test, not a hang
        got_lock.append(got)
        if got:
            waiter.release()

    reply.on_done(callback)

    def force_holding_the_lock():
        with waiter:
            holding.set()
            called.wait(WAIT)  # the lane is inside the callback now
            reply.force(LATE)  # needs the Reply's lock: free, the settle released it first
            forced.set()

    forcer = threading.Thread(target=force_holding_the_lock, daemon=True)
    lane = threading.Thread(target=lambda: holding.wait(WAIT) and reply.settle(0, Answer({"r": 1})), daemon=True)
    forcer.start()
    lane.start()
    lane.join(2 * WAIT)
    forcer.join(2 * WAIT)
    assert not lane.is_alive() and not forcer.is_alive()
    assert got_lock == [True], "the callback waited for the waiter's lock until it gave up: deadlock"
    assert forced.is_set() and reply.answer().outcome == {"r": 1}  # settled first: the force was a no-op


def test_a_request_of_several_texts_reports_the_widest_of_its_passes():
    reply = Reply(2)
    reply.settle(0, Answer({"r": 0}, 1, 32, arrived=1.0, started=1.5, finished=2.0, threads=1))
    reply.settle(1, Answer({"r": 1}, 1, 256, arrived=1.0, started=1.2, finished=3.0, threads=2))
    answer = reply.answer()
    assert (answer.threads, answer.started, answer.finished) == (2, 1.2, 3.0)
