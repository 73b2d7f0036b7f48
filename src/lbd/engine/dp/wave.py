"""A rank's view of waves: while a wave lasts every member steps (a dummy pass when it has nothing), and
every ``check_steps`` steps they all-reduce whether anyone still has work. Pure bookkeeping, no I/O.

Waves are numbered per generation from 0. Members end a wave together (the all-reduce gives every member
the same answer after the same number of steps: each step is one pass through the MoE layers, whose
collectives keep the members in lockstep), so ``next_id`` agrees everywhere. A ``wave_start`` for a wave
that already ended here is stale and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Wave:
    check_steps: int = 32
    active: bool = False
    id: int = 0  # the current wave's id, or the next one's while paused
    steps_in_wave: int = 0
    steps: int = 0  # passes in waves, this generation and before
    dummy_steps: int = 0
    waves: int = 0  # waves this rank took part in

    def start(self, wave_id: int | None = None) -> bool:
        """Enter wave ``wave_id`` (None: the next one, started here); False for a stale or current one."""
        if self.active or (wave_id is not None and wave_id != self.id):
            return False
        self.active, self.steps_in_wave = True, 0
        self.waves += 1
        return True

    def stepped(self, dummy: bool) -> bool:
        """Count one pass; True when this step must end with the idle all-reduce."""
        self.steps_in_wave += 1
        self.steps += 1
        self.dummy_steps += dummy
        return self.steps_in_wave % self.check_steps == 0

    def end(self) -> int:
        """The all-reduce said every member is idle; returns the id of the wave that ended."""
        ended = self.id
        self.active, self.id = False, self.id + 1
        return ended

    def reset(self) -> None:
        """A new generation numbers its waves from 0."""
        self.active, self.id, self.steps_in_wave = False, 0, 0
