"""A generation's states (a ``%%generate`` run's and an ``--over`` run's), in the order they move:
queued -> prefilling -> generating -> done | aborted | error. Plain strings: the views, the
session and the tests compare them, and none of them needs the generation to do so."""

QUEUED, PREFILLING, GENERATING = "queued", "prefilling", "generating"
DONE, ABORTED, ERROR = "done", "aborted", "error"
FINAL_STATES = frozenset({DONE, ABORTED, ERROR})
