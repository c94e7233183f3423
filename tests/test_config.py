"""Every engine and server option is declared once (``vllm_mlx/config/``): the CLI flags, the notebook's
``%vllm_mlx load`` flags, the keyword checks and the docs' tables are generated from the
declarations, and agree with them. So are the docs' tables of ``SchedulerConfig`` and
``SamplingParams``, from their fields (``described``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from vllm_mlx.config import options as config
from vllm_mlx.config import tables
from vllm_mlx.config import BENCH, ENGINE, NOTEBOOK, SERVE, EngineConfig, ServingOptions, options_of
from vllm_mlx.core.fields import described, field_doc
from vllm_mlx.core.request import SamplingParams
from vllm_mlx.core.sched.scheduler import SchedulerConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"


def subparser(command: str) -> argparse.ArgumentParser:
    from vllm_mlx.entrypoints.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions}


def declared(surface: str, cls=EngineConfig) -> list[tuple[dataclasses.Field, config.Option]]:
    return [(f, opt) for f, opt in options_of(cls) if surface in opt.surfaces]


def test_every_engine_config_field_is_declared():
    assert [f.name for f, _ in options_of(EngineConfig)] == [f.name for f in dataclasses.fields(EngineConfig)]


@pytest.mark.parametrize(
    "command, surfaces",
    [("generate", [ENGINE]), ("serve", [ENGINE, SERVE])],
)
def test_cli_flags_are_the_declared_options(command, surfaces):
    actions = actions_by_dest(subparser(command))
    classes = [EngineConfig, ServingOptions] if command == "serve" else [EngineConfig]
    for surface in surfaces:
        for f, opt in (item for cls in classes for item in declared(surface, cls)):
            action = actions[f.name]
            assert action.option_strings[0] == config.flag_of(f, opt)
            assert action.default == config.cli_default(f, opt), f.name
            assert action.help == opt.help.replace("%", "%%"), f.name
            if opt.choices:
                assert list(action.choices) == list(opt.choices() if callable(opt.choices) else opt.choices)
    # The other way round: every flag in the engine section is a declared option.
    parser = subparser(command)
    engine_group = next(g for g in parser._action_groups if g.title == config.ENGINE_GROUP)
    names = {f.name for surface in surfaces for f, _ in declared(surface)}
    assert {action.dest for action in engine_group._group_actions} <= names


def test_cli_flag_names_and_defaults_are_unchanged():
    """The flags users and scripts know (a sample written out by hand, as before the
    declarations): names, forms and defaults."""
    serve = subparser("serve")
    args = serve.parse_args([])
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.block_size) == (32, 512, 16)
    assert (args.kv_cache_memory, args.num_kv_blocks, args.mllm_cache_memory, args.seed) == (None, None, None, None)
    assert (args.enable_prefix_caching, args.trust_remote_code, args.weight_format) == (True, False, "auto")
    argv = ["--kv-cache-memory", "512M", "--mllm-cache-memory", "1G", "--no-enable-prefix-caching",
            "--distributed-timeout", "30", "--distributed-startup-timeout", "90", "--seed", "7"]  # fmt: skip
    args = serve.parse_args(argv)
    from vllm_mlx.entrypoints.cli import engine_options
    from vllm_mlx.entrypoints.openai.cli_args import serve_engine_options

    options = {**engine_options(args), **serve_engine_options(args)}
    assert options["kv_cache_memory"] == 512 << 20 and options["mllm_cache_memory"] == 1 << 30
    assert options["enable_prefix_caching"] is False and options["seed"] == 7
    assert (options["distributed_timeout_s"], options["distributed_startup_timeout_s"]) == (30.0, 90.0)
    assert serve.parse_args(["--kv-cache-memory", "0.3"]).kv_cache_memory == 0.3


def test_serve_builds_its_serving_options_from_the_declared_flags():
    from vllm_mlx.entrypoints.openai.cli_args import serving_options

    assert serving_options(subparser("serve").parse_args([])) == ServingOptions()
    argv = ["--tokenizer-threads", "3", "--stream-stall-timeout", "0", "--tool-call-parser", "hermes",
            "--enable-cache-stats-disclosure", "--allow-json-whitespace", "--max-n", "4"]  # fmt: skip
    options = serving_options(subparser("serve").parse_args(argv))
    assert (options.tokenizer_threads, options.stream_stall_timeout, options.tool_call_parser) == (3, 0.0, "hermes")
    assert options.enable_cache_stats_disclosure and options.allow_json_whitespace and options.limits.max_n == 4
    assert not options.enable_prompt_tokens_details and options.discloses_prefix_hits
    for bad in (["--tokenizer-threads", "0"], ["--tool-call-parser", "nope"], ["--stream-stall-timeout", "-1"]):
        with pytest.raises(SystemExit):
            subparser("serve").parse_args(bad)


def test_bench_flags_are_the_declared_options():
    from vllm_mlx.entrypoints.bench import build_parser

    actions = actions_by_dest(build_parser())
    for f, opt in declared(BENCH):
        assert actions[f.name].default == config.field_default(f)
    args = build_parser().parse_args(["--max-num-seqs", "4"])
    assert config.options_from_args(args, EngineConfig, BENCH) == {
        "model": "default", "max_num_seqs": 4, "max_num_batched_tokens": 512, "weight_format": "auto",
    }  # fmt: skip


def test_notebook_load_flags_are_the_declared_options():
    pytest.importorskip("IPython")
    from vllm_mlx_jupyter.options import load_parser, parse_load

    actions = actions_by_dest(load_parser())
    assert {f.name for f, _ in declared(NOTEBOOK)} == set(actions) - {"model"}
    argv = ["m", "--kv-cache-memory", "512M", "--max-num-seqs", "4", "--no-enable-prefix-caching"]
    model, options = parse_load(argv)
    assert model == "m"
    config_ = EngineConfig(**options)
    config_.normalize()
    assert (config_.kv_cache_memory, config_.max_num_seqs, config_.enable_prefix_caching) == (512 << 20, 4, False)


def test_an_unknown_option_names_the_close_ones():
    with pytest.raises(TypeError, match=r"unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'"):
        config.apply_options(EngineConfig(), {"max_num_seq": 8})
    with pytest.raises(TypeError, match=r"unknown engine option 'zzz'$"):
        config.apply_options(EngineConfig(), {"zzz": 8})


def test_llm_refuses_an_unknown_option_before_loading():
    from vllm_mlx.llm import LLM

    with pytest.raises(TypeError, match="did you mean 'kv_cache_memory'"):
        LLM("no-such-model-dir", kv_cache_memroy="512M")


def test_sizes_and_durations_parse_in_one_place():
    assert config.parse_bytes("512M") == 512 << 20 and config.parse_bytes("1.5GB") == 3 << 29
    assert config.parse_bytes(4096) == 4096
    assert config.parse_memory("0.3") == 0.3 and config.parse_memory("2G") == 2 << 30
    assert config.parse_seconds("0.5") == 0.5
    for bad in ("lots", "", True):
        with pytest.raises(ValueError, match="not a size"):
            config.parse_bytes(bad)
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(ValueError):
            config.parse_seconds(bad)


def test_normalize_checks_every_declared_field():
    for name, bad in [("max_num_seqs", 0), ("num_kv_blocks", "8"), ("enable_chunked_prefill", "yes"),
                      ("trust_remote_code", 1), ("distributed_timeout_s", 0), ("mllm_cache_memory", "big")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: bad}).normalize()


@pytest.mark.parametrize("bad", [0, -5, "-1G"])
def test_a_memory_limit_below_one_byte_is_refused(bad):
    with pytest.raises(ValueError, match="memory_limit must be a size of at least 1 bytes"):
        EngineConfig(memory_limit=bad).normalize()
    good = EngineConfig(memory_limit="16G")
    good.normalize()
    assert good.memory_limit == 16 << 30



@pytest.mark.parametrize("cls", [SchedulerConfig, SamplingParams], ids=lambda cls: cls.__name__)
def test_every_scheduler_and_sampling_field_is_described(cls):
    """Their docs tables are generated from the fields' declarations (``described``): each has a
    meaning, and the table has a row per field, in order, with the field's type and default."""
    table = tables.described_table(cls)
    assert len(table) == 2 + len(dataclasses.fields(cls))
    for f, row in zip(dataclasses.fields(cls), table[2:]):
        assert row.startswith(f"| `{f.name}` | `{f.type}` | ") and row.endswith(f" | {field_doc(f)} |")


def test_a_field_without_a_description_fails_its_table():
    @dataclasses.dataclass
    class Limits:
        named: int = described(1, doc="has a meaning")
        bare: int = 2

    with pytest.raises(ValueError, match="'bare' has no description"):
        tables.described_table(Limits)


def test_docs_tables_are_the_generated_ones():
    """Every ``<!-- generated: NAME -->`` block of the docs holds what ``python -m
    vllm_mlx.config --write PAGE`` writes, and every generated table appears somewhere."""
    found = set()
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        if "<!-- generated: " not in text:
            continue
        assert text == tables.replace_tables(text), f"{page.name}: run python -m vllm_mlx.config --write {page}"
        found |= {line.removeprefix("<!-- generated: ").removesuffix(" -->")
                  for line in text.splitlines() if line.startswith("<!-- generated: ")}  # fmt: skip
    assert found == set(tables.GENERATED_TABLES)


def test_notebook_engine_options_are_checked_at_config():
    pytest.importorskip("IPython")
    from traitlets import TraitError

    from vllm_mlx_jupyter.magics import GenerateMagics

    magics = GenerateMagics(shell=None)
    magics.engine_options = {"num_kv_blocks": 64, "kv_cache_memory": "8M"}
    with pytest.raises(TraitError, match="did you mean 'max_num_seqs'"):
        magics.engine_options = {"max_num_seq": 4}
    assert magics.engine_options == {"num_kv_blocks": 64, "kv_cache_memory": "8M"}
