"""Retry a flaky call with exponential backoff and jitter."""

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Type, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    initial: float = 0.1
    factor: float = 2.0
    maximum: float = 5.0
    jitter: float = 0.1

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before retry number `attempt` (1 for the first)."""
        base = min(self.maximum, self.initial * self.factor ** (attempt - 1))
        spread = base * self.jitter
        return max(0.0, base + rng.uniform(-spread, spread))


class RetryError(Exception):
    def __init__(self, attempts: int, last: BaseException) -> None:
        super().__init__(f"gave up after {attempts} attempts: {last!r}")
        self.attempts = attempts
        self.last = last


def retry(
    call: Callable[[], T],
    attempts: int = 3,
    retry_on: Tuple[Type[BaseException], ...] = (OSError, TimeoutError),
    backoff: Backoff = Backoff(),
    sleep: Callable[[float], None] = time.sleep,
    rng: Optional[random.Random] = None,
) -> T:
    """Call `call` until it returns, at most `attempts` times in all.

    Exceptions in `retry_on` are retried after a backoff delay; any other
    exception propagates at once. Raises RetryError when every attempt
    failed.
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    rng = rng or random.Random()
    last: Optional[BaseException] = None
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except retry_on as exc:
            last = exc
            if attempt < attempts:
                sleep(backoff.delay(attempt, rng))
    assert last is not None
    raise RetryError(attempts, last)


def retrying(attempts: int = 3, **options):
    """Decorator form of `retry` for functions without arguments."""

    def wrap(fn: Callable[[], T]) -> Callable[[], T]:
        def inner() -> T:
            return retry(fn, attempts=attempts, **options)

        inner.__name__ = fn.__name__
        inner.__doc__ = fn.__doc__
        return inner

    return wrap
