"""A test module's multi-rank scenarios on one launch of two ranks: the ranks start once (two
interpreters importing MLX and vllm_mlx, then forming the ring: 15-25 s on 2 cores) and run the
scenarios in turn, each on a fresh engine (rank 0) and ``worker_loop`` (the others), shut down
before the next one starts.

The test side, ``launch_scenarios``, writes the plan (``OUT_DIR/plan.json``: the ``Scenario``s in
order) and launches ``DRIVER OUT_DIR`` on two ranks. Each rank's driver calls ``run_scenarios``
with one function per scenario kind; as each scenario ends, every rank writes (``outcome_path``):

- ``NAME.rankN.json``: what the scenario's function returned;
- ``NAME.rankN.refused``: the ``TensorParallelError`` it raised. Start-up refusals come after the
  same collectives on every rank (the split mode, the model digests) and then raise alike, so
  the ring is in step for the next scenario;
- ``NAME.rankN.error``: the traceback of any other exception. The next scenarios still run: an
  error on rank 0 passes through its engine's ``shutdown``, whose "stop" returns the workers.

A scenario that could leave one rank inside a collective the other never issues (a refusal on
one rank only, were it to regress) would put the ranks out of step for the rest of the launch, so
the refusal scenarios go last: the plan's order is the order they run in.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

TESTS = Path(__file__).parent  # tests/distributed: the ranks import from it, from tests/ and from the repository
# Seconds a scenario gets: a model load and ~40 steps take ~30 s on 2 cores, 4 min with 6 other jobs.
LAUNCH_TIMEOUT = 400
RANKS = 2
PLAN = "plan.json"


@dataclass
class Scenario:
    """One scenario of a launch: ``kind`` names the driver's function that runs it, ``name`` its
    outcome files; every rank loads ``model``, except that ranks > 0 load ``other_model`` when
    given (to check that the ranks refuse differing models)."""

    name: str
    kind: str
    model: str
    other_model: str = ""

    def model_for(self, rank: int) -> str:
        return self.other_model if rank > 0 and self.other_model else self.model


def outcome_path(out_dir: Path, name: str, rank: int, what: str) -> Path:
    """Where rank ``rank`` writes scenario ``name``'s outcome: ``what`` is json, refused or error."""
    return out_dir / f"{name}.rank{rank}.{what}"


# The ranks' side.

ScenarioFunction = Callable[..., dict]
"""``(group, scenario) -> dict``: this rank's result (JSON-able); every rank calls it in turn."""


def run_scenarios(functions: dict[str, ScenarioFunction], out_dir: str | None = None) -> None:
    """Run the plan in ``out_dir`` (default: the command line's first argument) on this rank,
    writing each scenario's outcome as soon as it ends."""
    from vllm_mlx.distributed.group import TensorParallelError, init_group

    out = Path(out_dir or sys.argv[1])
    group = init_group()
    for scenario in [Scenario(**s) for s in json.loads((out / PLAN).read_text())]:
        path = partial(outcome_path, out, scenario.name, group.rank())
        try:
            result = functions[scenario.kind](group, scenario)
        except TensorParallelError as exc:
            path("refused").write_text(str(exc))
        except Exception:
            path("error").write_text(traceback.format_exc())
            traceback.print_exc()  # into the launch's output too
        else:
            path("json").write_text(json.dumps(result))


# The tests' side.


@dataclass
class LaunchedScenarios:
    """What one launch left: its scenarios (by name), their outcome files and the launcher's output."""

    out_dir: Path
    scenarios: dict[str, Scenario]
    output: str  # the launcher's and every rank's, interleaved
    timed_out: bool

    def results(self, name: str) -> list[dict]:
        """Every rank's result of scenario ``name``; the test fails, saying why, where a rank has none."""
        paths = [outcome_path(self.out_dir, name, rank, "json") for rank in range(RANKS)]
        if not all(p.exists() for p in paths):  # (mlx.launch exits 0 regardless)
            _fail(self.why_missing(name, "a result"))
        return [json.loads(p.read_text()) for p in paths]

    def refusals(self, name: str) -> list[str]:
        """Every rank's refusal of scenario ``name``; the test fails, saying why, where a rank has none."""
        paths = [outcome_path(self.out_dir, name, rank, "refused") for rank in range(RANKS)]
        if not all(p.exists() for p in paths):
            _fail(self.why_missing(name, "a refusal"))
        return [p.read_text() for p in paths]

    def result_files(self, name: str) -> list[Path]:
        return sorted(self.out_dir.glob(f"{name}.rank*.json"))

    def why_missing(self, name: str, what: str) -> str:
        """The scenario's outcomes on each rank, every scenario's errors (an earlier one may have
        put the ranks out of step), whether the launch timed out, and the end of its output."""
        have = [p.name for p in sorted(self.out_dir.glob(f"{name}.rank*"))]
        errors = "".join(f"\n--- {p.name}:\n{p.read_text()[-3000:]}" for p in sorted(self.out_dir.glob("*.error")))
        ended = f"timed out after {launch_timeout(len(self.scenarios))} s" if self.timed_out else "ended"
        return (
            f"scenario {name!r}: not every rank wrote {what} (found: {have or 'nothing'}); the launch {ended}"
            f"{errors}\n--- output:\n{self.output[-3000:]}"
        )


def _fail(message: str):
    import pytest

    pytest.fail(message, pytrace=False)


def launch_timeout(num_scenarios: int) -> int:
    """Each scenario keeps the time it had when it was a launch of its own."""
    return LAUNCH_TIMEOUT * num_scenarios


def launch_scenarios(out_dir: Path, scenarios: list[Scenario], driver: Path) -> LaunchedScenarios:
    """Run ``scenarios`` in order on one launch of ``driver`` (which calls ``run_scenarios``);
    skips where ``mlx.launch`` cannot run. A timeout does not fail here: each test fails on its
    own scenario's missing outcome, with the output."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PLAN).write_text(json.dumps([asdict(s) for s in scenarios]))
    done = launch_ranks(driver, [str(out_dir)], launch_timeout(len(scenarios)))
    return LaunchedScenarios(out_dir, {s.name: s for s in scenarios}, done.output, done.timed_out)


def launch_ranks(driver: Path | str, args: list[str], timeout: float):
    """``driver`` on two ranks (``launch_ring``: its own session, killed whole on timeout) with
    ``args``; the test skips where ``mlx.launch`` cannot run. Returns the ``LaunchResult``."""
    import mlx.core as mx
    import pytest

    from vllm_mlx.distributed.launch import LaunchError, launch_ring

    if not mx.distributed.is_available():
        pytest.skip("mlx has no distributed backend")
    try:
        return launch_ring(str(driver), args, ranks=RANKS, timeout=timeout,
                           pythonpath=[str(TESTS.parents[1]), str(TESTS.parent), str(TESTS)])  # fmt: skip
    except LaunchError as exc:
        pytest.skip(str(exc))
