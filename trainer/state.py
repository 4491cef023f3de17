"""What the trainer's checkpoint holds besides model and optimizer: one mutable dataclass shared by
the loop's components (each updates its own fields), saved whole and restored in place."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class State:
    step: int = 0
    version: int = 0
    # Cumulative counters (exported to Prometheus as tandem_trainer_<name>_total; a restart
    # continues from the checkpoint's totals).
    samples: int = 0
    completion_tokens: int = 0
    versions_published: int = 0
    dropped_stale: int = 0
    dropped_fingerprint: int = 0
    # (stream_id, sample_id) of every sample consumed since the previous checkpoint
    pending_commit: list = field(default_factory=list)
    # Exactly-once without trusting Redis: the next prompt index to feed, and every group fed and
    # not yet used or dropped (group_id -> prompt index). A sample of any other group is refused,
    # and after Redis lost the queue (trainer.feeding rule 1) these are fed again.
    prompt_seq: int = 0
    outstanding: dict = field(default_factory=dict)
    # Groups settled without training since the last audit line: listed in the next one, also when
    # that line is written after a stop and resume (a stop mid-collect writes no audit line).
    dropped_unaudited: list = field(default_factory=list)
    # Totals over the whole run (persisted: a restart does not reset them).
    invalid: int = 0  # samples refused by trainer.validation, dead-lettered with the reason
    malformed: int = 0  # undecodable trajectory entries, dead-lettered
    duplicates: int = 0  # samples already used or already held, acked and dropped
    dead_lettered: int = 0  # entries dead-lettered after more than max_deliveries deliveries
    refed: int = 0  # prompts fed again after Redis lost them
    unsigned: int = 0  # trajectory entries without a valid run-secret signature, dead-lettered
    prompts_dead_lettered: int = 0  # fed prompt groups the workers dead-lettered, settled as dropped

    def restore(self, saved: dict) -> None:
        """Take a checkpoint's values in place (fields it lacks keep their defaults); a key that is
        no field of State is refused."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(saved) - names)
        if unknown:
            raise ValueError(f"checkpoint state has unknown fields {unknown}")
        defaults = vars(State())
        for name in names:
            setattr(self, name, saved.get(name, defaults[name]))
