"""`ReadSchedule`: which env steps of one sub-env anyone reads, so its adapter renders only those.

The protocol is `wrappers.freeze`'s "Reading schedule": once told ``set_read_every(C)``, a sub-env's images
are read at resets, at the step that ends an episode (terminated or truncated), and at every C-th env step
since its last reset; other steps may return stale images (the state vector stays current). A schedule
starts at C = 1, so an env renders every step until somebody says otherwise.

An adapter keeps one schedule per sub-env and asks it at two moments:

* before a step, `must_read_next` -- whether the coming step is read whatever happens (simulators that
  render inside their own step, such as robosuite, have to decide before it);
* after the step, `count_step(done)` -- whether the step just taken is read (an episode end is only known
  now; MuJoCo renders after the step, so this is all it needs).

Example:
    >>> schedule = ReadSchedule()
    >>> schedule.set_every(3); schedule.reset()
    >>> [schedule.count_step(done=False) for _ in range(4)]
    [False, False, True, False]
    >>> schedule.count_step(done=True)    # an episode end is always read
    True
"""

from __future__ import annotations

from policies.checks import check_int


class ReadSchedule:
    """Counts one sub-env's env steps since its last reset and says which ones are read.

    Attributes:
        every: C, read every C-th step since a reset (1: every step).
        steps: env steps since the last reset.
    """

    def __init__(self) -> None:
        self.every = 1
        self.steps = 0

    def set_every(self, chunk: int) -> None:
        """Reads every `chunk`-th step from now on (`PolicyVectorEnv` passes its action chunk C)."""
        self.every = check_int("set_read_every: chunk", chunk, minimum=1, fix="pass the action chunk C >= 1")

    def reset(self) -> None:
        """A real reset: its observation is read, and counting starts again."""
        self.steps = 0

    def must_read_next(self) -> bool:
        """True when the coming step is read whether or not it ends the episode."""
        return (self.steps + 1) % self.every == 0

    def count_step(self, done: bool) -> bool:
        """Counts one env step; True when it is read (it ended the episode or is a C-th step)."""
        self.steps += 1
        return bool(done) or self.steps % self.every == 0
