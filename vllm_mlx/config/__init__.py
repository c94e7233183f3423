"""Every engine and server option, declared once: ``EngineConfig``, ``ServingOptions`` and what
each of their fields means.

A field is declared with ``option(default, help=..., ...)``: its name, type (the annotation),
default, unit, help and the surfaces that show it live on the field (``Option`` in its
metadata). Everything else is read from there:

- the CLI flags of ``vllm-mlx generate``/``serve``/``bench`` (``options.add_arguments``) and
  the values they set (``options.options_from_args``);
- the server's ``ServingOptions`` from its flags (``cli_args.serving_options``);
- the notebook's ``%vllm_mlx load --flag`` (``vllm_mlx_jupyter/options.py``) and the names
  ``%config GenerateMagics.engine_options`` accepts;
- the checks of ``LLM(...)``/``EngineCore(...)`` keywords (``options.apply_options``: an unknown
  name is a ``TypeError`` naming the close ones) and of values (``EngineConfig.normalize``);
- the configuration tables of the docs (``tables``; ``python -m vllm_mlx.config --markdown``
  prints them, ``--write docs/configuration.md`` puts them in place).

Sizes (``512M``) and durations are parsed in ``options`` and nowhere else. Pure Python: no MLX,
and no import of the engine (``vllm_mlx.engine.core`` re-exports ``EngineConfig`` from here).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_mlx.config.options import (
    BENCH,
    BYTES,
    DISTRIBUTED_GROUP,
    ENGINE,
    MEMORY,
    NOTEBOOK,
    SECONDS,
    SERVE,
    checked_value,
    option,
    options_of,
    parse_count,
)
from vllm_mlx.core.sched.prefill_budget import DEFAULT_PREFILL_ATTENTION_TOKENS
from vllm_mlx.core.spec_decode.config import DRAFT_MODEL, SpeculativeConfig, parse_speculative_config
from vllm_mlx.distributed.watchdog import DEFAULT_STARTUP_TIMEOUT_S
from vllm_mlx.platform.validation import RequestLimits
from vllm_mlx.structured.bounds import DEFAULT_MAX_CONSTRAINT_BOUND

if TYPE_CHECKING:
    from vllm_mlx.core.sched.scheduler import SchedulerConfig
    from vllm_mlx.multimodal.media_policy import MediaPolicy

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB
DEFAULT_MLLM_CACHE_MEMORY = 512 << 20  # 512 MiB
DEFAULT_KV_DISK_BUDGET = 8 << 30  # 8 GiB
DEFAULT_KV_DISK_WRITE_BUDGET = 16 << 30  # 16 GiB an hour: a tenth of a typical SSD's rated writes


# -- EngineConfig ------------------------------------------------------------------------------


@dataclass
class EngineConfig:
    """Everything needed to build an engine; CLI flags and ``LLM(**options)`` map onto it.

    Each field is declared once, with its help and where it shows (``option``); see the module."""

    model: str = option(
        "default", surfaces=(ENGINE, BENCH), group=None, help="MLX directory, .gguf file, hub id or 'default'",
        doc="model source: an MLX model directory, a `.gguf` file, a Hugging Face repo id, or `\"default\"` "
        "(the built-in SmolLM2-135M-Instruct)",
        doc_flag="`--model` (or `MODEL` for `serve`)",
    )  # fmt: skip
    max_num_seqs: int = option(
        32, surfaces=(ENGINE, BENCH, NOTEBOOK), minimum=1, help="most requests in one batch",
        doc="most requests running in one batch",
    )  # fmt: skip
    max_num_batched_tokens: int = option(
        512, surfaces=(ENGINE, BENCH, NOTEBOOK), minimum=1, help="token budget of one step",
        doc="token budget of one step: prefill chunks plus one token per decoding request",
    )  # fmt: skip
    block_size: int = option(16, surfaces=(ENGINE, NOTEBOOK), minimum=1, help="tokens per KV block")
    num_kv_blocks: int | None = option(
        None, surfaces=(ENGINE, NOTEBOOK), minimum=1, help="KV blocks (overrides --kv-cache-memory)",
        doc="blocks in the KV pool; `None` sizes the pool from `kv_cache_memory`",
    )  # fmt: skip
    kv_cache_memory: int | float = option(
        DEFAULT_KV_CACHE_MEMORY, surfaces=(ENGINE, NOTEBOOK), unit=MEMORY, cli_default=None,
        help="KV pool size: bytes (512M, 2G) or a fraction of available memory (0.3)",
        doc="KV pool budget when `num_kv_blocks` is `None`: bytes (an `int`; the default is 1 GiB) or a fraction "
        "in (0, 1] of the memory available when the engine starts (a `float`)",
    )  # fmt: skip
    kv_disk_path: str | None = option(
        None, surfaces=(ENGINE, NOTEBOOK), flag="--kv-disk", metavar="DIR",
        help="keep prompt KV blocks in this folder, for later processes too (the disk tier; default: off; "
        "notebooks: on, in the user cache)",
        doc="the KV disk tier's folder: prompt blocks are written there (content-addressed, checked on read) and "
        "prefix lookups that miss in memory continue there, across processes; `None` = off (notebooks turn it on "
        "in the user cache) ([Caching explained](caching.md#the-disk-tier))",
    )  # fmt: skip
    kv_disk_budget: int = option(
        DEFAULT_KV_DISK_BUDGET, surfaces=(ENGINE, NOTEBOOK), unit=BYTES, minimum=1, cli_default=None,
        help="bytes the disk tier may keep, least recently used first out (default: 8G)",
        doc="bytes of blocks the disk tier keeps in its folder (8 GiB); the least recently used go first",
    )  # fmt: skip
    kv_disk_write_budget: int | None = option(
        DEFAULT_KV_DISK_WRITE_BUDGET, surfaces=(ENGINE, NOTEBOOK), unit=BYTES, minimum=1, cli_default=None,
        help="bytes the disk tier may write in any hour, to spare an SSD (default: 16G)",
        doc="bytes the disk tier may write in any hour (16 GiB); blocks over it are not written (counted in "
        "the stats); `None` = no limit",
    )  # fmt: skip
    enable_lora: bool = option(
        False, surfaces=(ENGINE, NOTEBOOK), help="serve LoRA adapters beside the base model, many in one batch",
        doc="serve LoRA adapters (mlx-lm's or PEFT's files) beside the base model: a request names one with "
        "`lora_request=LoRARequest(name, id, path)`; rows of different adapters share every forward",
    )  # fmt: skip
    max_loras: int = option(
        4, surfaces=(ENGINE, NOTEBOOK), minimum=1, help="adapters held at once (slots; the least recently used goes)",
        doc="adapters held in memory at once (slots); a request whose adapter finds no slot free of running requests "
        "waits; the least recently used adapter makes room",
    )  # fmt: skip
    max_lora_rank: int = option(
        16, surfaces=(ENGINE, NOTEBOOK), minimum=1, help="the largest adapter rank served",
        doc="the largest LoRA rank served (every slot holds factors of this rank; smaller ranks are zero-padded)",
    )  # fmt: skip
    max_model_len: int | None = option(
        None, surfaces=(ENGINE, NOTEBOOK), minimum=1, help="longest prompt + output (default: the model's)",
        doc="longest prompt + output; `None` = the model's context length (`max_position_embeddings`)",
    )  # fmt: skip
    enable_prefix_caching: bool = option(
        True, surfaces=(ENGINE, NOTEBOOK), help="reuse KV blocks of repeated prefixes (default: on)",
        doc="reuse the KV blocks of repeated prefixes ([Caching explained](caching.md))",
    )  # fmt: skip
    enable_chunked_prefill: bool = option(
        True, surfaces=(ENGINE, NOTEBOOK), help="prefill long prompts in chunks between decode steps (default: on)",
        doc="prefill long prompts in chunks between decode steps",
    )  # fmt: skip
    prefill_attention_tokens: int = option(
        DEFAULT_PREFILL_ATTENTION_TOKENS, surfaces=(ENGINE, NOTEBOOK), minimum=0, cli_default=None,
        help="charge prefill chunks for attention: the context length at which a token's attention costs as much "
        f"as its weights (default: {DEFAULT_PREFILL_ATTENTION_TOKENS}; 0: chunks cost their token count)",
        doc="charge each prefill chunk for its attention in the step's budget (`prefill_budget.PrefillCost`): a "
        "chunk of `n` tokens starting at context position `p` costs `n * (1 + (p + n/2) / "
        "prefill_attention_tokens)` of `max_num_batched_tokens`, so chunks shrink as a long prompt's context grows "
        "and a stream decoding beside it keeps a bounded gap between tokens; decode rows cost 1; `0` = a chunk "
        "costs its token count (the old policy); only with chunked prefill "
        "([Benchmarks](benchmarks.md#prefill-beside-a-decoding-stream-benchprefill_interferencepy))",
    )  # fmt: skip
    max_state_checkpoints: int | None = option(
        None, surfaces=(ENGINE, NOTEBOOK), minimum=0,
        help="hybrid models: recurrent states kept at block boundaries for prefix hits "
        "(default: 2 x max-num-seqs, at most half the KV budget; 0: no prefix hits)",
        doc="hybrid models: recurrent states kept at block boundaries for prefix hits, paid out of the KV budget; "
        "`None` = `2 * max_num_seqs`, at most half of the budget left after the running requests' states; "
        "`0` = no prefix hits ([Caching explained](caching.md#recurrent-layers))",
    )  # fmt: skip
    seed: int | None = option(
        None, surfaces=(SERVE, NOTEBOOK), group=None, help="seed drawn from for requests that bring none",
        doc="seeds the per-request seeds drawn for requests that bring none (`None` = random)",
        doc_flag="`--seed` (`serve` only)",
    )  # fmt: skip
    weight_format: str = option(
        "auto", surfaces=(ENGINE, BENCH, NOTEBOOK), choices=("auto", "quantized", "float32", "bfloat16"),
        help="auto: quantized on Metal/CUDA; on the CPU backend float32, else bfloat16, else quantized, the first "
        "that fits --memory-limit",
        doc="`\"auto\"`, `\"quantized\"`, `\"float32\"` or `\"bfloat16\"`; auto keeps quantized weights on Metal and "
        "CUDA, and on the CPU backend runs the fastest format whose weights and KV pool fit `memory_limit`: float32, "
        "else bfloat16, else the checkpoint's quantized weights; a format that cannot fit is refused before loading "
        "([Weight formats and memory](installation.md#weight-formats-and-memory))",
    )  # fmt: skip
    memory_limit: int | None = option(
        None, surfaces=(ENGINE, BENCH, NOTEBOOK), unit=BYTES, minimum=1,
        help="bytes the engine may use for weights and pools, e.g. 16G (default: the memory available at start "
        "less a margin)",
        doc="bytes the engine may use for its weights, KV pool and vision cache, checked before the weights load "
        "(it decides what `weight_format=\"auto\"` picks on the CPU backend); `None` = the memory available at start "
        "less a margin (10%, at least 1 GiB) ([Weight formats and memory](installation.md#weight-formats-and-memory))",
    )  # fmt: skip
    force_model_takeover: bool = option(
        False, surfaces=(NOTEBOOK,),
        help="take the model over from another live engine instead of raising ModelOwnershipError",
        doc="take the model over from another live engine instead of raising `ModelOwnershipError` "
        "([Troubleshooting](troubleshooting.md#model-ownership))",
    )  # fmt: skip
    enable_mllm_cache: bool = option(
        True, surfaces=(ENGINE, NOTEBOOK),
        help="vision-language models: reuse vision-encoder outputs of repeated images (default: on)",
        doc="vision-language models: keep vision-encoder outputs by image content hash, so the same image in a "
        "later request skips the encoder ([Images](images.md))",
    )  # fmt: skip
    mllm_cache_memory: int = option(
        DEFAULT_MLLM_CACHE_MEMORY, surfaces=(ENGINE, NOTEBOOK), unit=BYTES, cli_default=None,
        help="bytes of vision-encoder outputs the MLLM cache may hold (default: 512M)",
        doc="bytes of vision-encoder outputs the MLLM cache may hold (512 MiB); the least recently used go first",
    )  # fmt: skip
    trust_remote_code: bool = option(
        False, surfaces=(ENGINE, NOTEBOOK),
        help="load a model whose configs name Python code to run (model_file, auto_map), and fetch *.py files "
        "from the hub",
        doc="load a model whose configs name Python code to run (`model_file`, `auto_map`); otherwise it is "
        "refused, and hub downloads skip `*.py` ([Model code](serving.md#model-code))",
    )  # fmt: skip
    media_policy: MediaPolicy | None = option(
        None, help="which image paths and URLs prompts may use",
        doc="which image paths and URLs prompts may use; `None` = `MediaPolicy.operator()`: any local regular "
        "file, public http(s) URLs ([Media inputs](serving.md#media-inputs)). The server loads request images "
        "under its own policy (`MediaPolicy.server()`), built from its flags",
        doc_flag="— (`serve`: the media flags)",
    )  # fmt: skip
    tensor_parallel: bool = option(
        False, surfaces=(NOTEBOOK,), help="split the model over the ranks of mx.distributed (this process: rank 0)",
        doc="split the model over the ranks of `mx.distributed`: this process must be rank 0 of ranks launched "
        "with `mlx.launch`, the others run `vllm_mlx.engine.rank_worker.worker_loop` with the same model and "
        "`weight_format` ([Distributed](distributed.md))",
    )  # fmt: skip
    pipeline_parallel: bool = option(
        False, surfaces=(NOTEBOOK,),
        help="split the model's layers into stages over the ranks of mx.distributed (this process: rank 0)",
        doc="split the model's layers into stages over the ranks of `mx.distributed` (mlx-lm's `pipeline()`): "
        "launched as with `tensor_parallel`, the others run `worker_loop(..., pipeline_parallel=True)`; not with "
        "`tensor_parallel` ([Distributed](distributed.md#pipeline-parallelism))",
    )  # fmt: skip
    distributed_timeout_s: float = option(
        120.0, surfaces=(SERVE, NOTEBOOK), unit=SECONDS, minimum=0, flag="--distributed-timeout",
        cli_default=None, metavar="SECONDS", group=DISTRIBUTED_GROUP,
        help="how long a step may wait on the other ranks before one is declared hung and the server unhealthy "
        "(default: 120)",
        doc="with `tensor_parallel` or `pipeline_parallel`: how long a step (or the idle heartbeat) may wait on "
        "the other ranks before rank 0 declares one hung and the engine failed (`distributed/watchdog.py`); it must "
        "exceed the slowest legitimate step, the largest prefill chunk on this hardware "
        "([Distributed](distributed.md#when-a-rank-dies-or-hangs))",
    )  # fmt: skip
    distributed_startup_timeout_s: float = option(
        DEFAULT_STARTUP_TIMEOUT_S, surfaces=(SERVE, NOTEBOOK), unit=SECONDS, minimum=0,
        flag="--distributed-startup-timeout", cli_default=None, metavar="SECONDS", group=DISTRIBUTED_GROUP,
        help="how long start-up (every rank loading the model) may take before a rank gives up on the others "
        f"and exits (default: {DEFAULT_STARTUP_TIMEOUT_S:g})",
        doc="with `tensor_parallel` or `pipeline_parallel`: how long start-up (every rank loading and checking "
        "the model, then the start message) may take before a rank gives up on the others and exits with "
        "status 1; it must exceed the slowest rank's load ([Distributed](distributed.md#when-a-rank-dies-or-hangs))",
    )  # fmt: skip
    speculative_config: SpeculativeConfig | None = option(
        None, surfaces=(ENGINE, BENCH, NOTEBOOK), parse=parse_speculative_config, metavar="JSON",
        help='speculative decoding: vLLM\'s keys as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\', '
        "or a method's name alone (ngram) (default: off)",
        doc="speculative decoding inside the batch: a `SpeculativeConfig`, a dict of its keys or their JSON "
        "(`method` `\"ngram\"`: prompt lookup, `\"draft_model\"` with `model`: a smaller model with the same "
        "tokenizer; `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`, `adaptive`); output is token for token the same as without it; `None` = off "
        "([Speculative decoding](speculative_decoding.md))",
    )  # fmt: skip
    max_constraint_bound: int = option(
        DEFAULT_MAX_CONSTRAINT_BOUND, surfaces=(NOTEBOOK,), minimum=1,
        help="largest repetition bound in a structured-output constraint (maxItems, regex {n,m}, ...)",
        doc="the largest repetition bound (`maxItems`, `maxLength`, a regex's `{n,m}`, ...) a structured-output "
        "constraint may hold; all of one constraint's bounds may add up to 10 times it "
        "([Structured outputs](structured_outputs.md#limits))",
        doc_flag="— (`serve`: `--max-constraint-bound`, the server's own)",
    )  # fmt: skip

    def normalize(self) -> None:
        """Accept every option in the forms the CLI takes (``kv_cache_memory="512M"`` or
        ``"0.3"``, ``mllm_cache_memory="256M"``) and check types and ranges, so that
        ``LLM(...)``, notebooks and the CLI agree. Raises ``ValueError`` naming the option."""
        for f, opt in options_of(EngineConfig):
            setattr(self, f.name, checked_value(f, opt, getattr(self, f.name)))
        if self.tensor_parallel and self.pipeline_parallel:
            raise ValueError("tensor_parallel and pipeline_parallel are exclusive: choose one way to split the model")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        spec = self.speculative_config
        if spec is not None and spec.method == DRAFT_MODEL and (self.tensor_parallel or self.pipeline_parallel):
            raise ValueError("a draft model does not work with tensor_parallel or pipeline_parallel "
                             "(it would run unsplit on rank 0); n-gram lookup does")  # fmt: skip
        if self.enable_lora and (self.tensor_parallel or self.pipeline_parallel):
            raise ValueError("enable_lora does not work with tensor_parallel or pipeline_parallel yet")

    def scheduler_config(self, num_blocks: int, context_len: int | None) -> SchedulerConfig:
        """The scheduler's limits for a pool of ``num_blocks`` and a model context of ``context_len``."""
        from vllm_mlx.core.sched.scheduler import SchedulerConfig

        limits = [n for n in (self.max_model_len, context_len) if n]
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_chunked_prefill=self.enable_chunked_prefill,
            prefill_attention_tokens=self.prefill_attention_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            max_model_len=min(limits) if limits else None,
        )


# -- ServingOptions: the server's own decisions (``vllm-mlx serve``) ---------------------------

DEFAULT_STREAM_STALL_TIMEOUT_S = 60.0  # a streamed response whose client reads nothing this long is aborted
SERVER_GROUP = "server"


def tool_parser_names() -> tuple[str, ...]:
    """The ``--tool-call-parser`` names (read when a parser is built: the registry loads them)."""
    from vllm_mlx.tool_parsers.registry import ALIASES, PARSER_NAMES

    return tuple(sorted([*PARSER_NAMES, *ALIASES]))


@dataclass(frozen=True)
class ServingOptions:
    """What the operator decides about serving (``vllm-mlx serve`` flags); safe defaults.

    ``limits`` come from ``RequestLimits``' own declared fields (``--max-...``); the others are
    declared here, each once (``option``)."""

    limits: RequestLimits = field(default_factory=RequestLimits)
    enable_prompt_tokens_details: bool = option(
        False, surfaces=(SERVE,), group=SERVER_GROUP,
        help="report usage.prompt_tokens_details.cached_tokens (tells clients about other tenants' prompts)",
        doc="report `usage.prompt_tokens_details.cached_tokens` (vLLM's flag); off by default: the count tells a "
        "client whether other tenants' prompts began like its own",
    )  # fmt: skip
    cache_stats_per_request: bool = option(
        False, surfaces=(SERVE,), group=SERVER_GROUP,
        help="list live requests (ids, token counts) in /v1/cache/stats (default: aggregates only)",
        doc="list live requests (ids, token counts) in `/v1/cache/stats`; unset: aggregates only",
    )  # fmt: skip
    enable_cache_stats_disclosure: bool = option(
        False, surfaces=(SERVE,), group=SERVER_GROUP,
        help="show prefix-cache counters (hits, cached tokens, allocations; also per cache_salt) in /v1/cache/stats, "
        "/v1/cache/blocks and /metrics (they tell clients about other tenants' prompts)",
        doc="show the prefix-cache counters (hits, cached tokens, allocations, the real block grid) in "
        "`/v1/cache/stats`, `/v1/cache/blocks` and `/metrics`, also per tenant (`cache_salt`); unset: only numbers "
        "no prefix hit changes, since they tell a client whether its guess of another tenant's prompt was right "
        "([Serving](serving.md#tenants))",
    )  # fmt: skip
    tool_call_parser: str | None = option(
        None, surfaces=(SERVE,), group=SERVER_GROUP, choices=tool_parser_names,
        help="the model's output format for tool calls (and gpt-oss's Harmony channels); default: recognised from "
        "the chat template",
        doc="the model's output format for tool calls with `tool_choice: auto`, and gpt-oss's Harmony channels "
        "(`hermes`, `qwen3_coder`, `llama3_json`, `mistral`, `harmony`; unset: recognised from the chat template)",
    )  # fmt: skip
    tokenizer_threads: int = option(
        4, surfaces=(SERVE,), group=SERVER_GROUP, minimum=1, parse=parse_count, metavar="N",
        help="prompts tokenized at once (default: 4); a prompt too long for the context is refused before",
        doc="prompts tokenized at once, off the event loop (`TokenizePool`); long prompts hold at most all but one "
        "thread, so short ones never wait behind them, and one too long for the context is refused from its "
        "length before ([Serving](serving.md#fair-service))",
    )  # fmt: skip
    allow_json_whitespace: bool = option(
        False, surfaces=(SERVE,), group=SERVER_GROUP,
        help="let JSON constraints (response_format; structured_outputs json without disable_any_whitespace) "
        "have free whitespace between tokens (default: compact JSON, which sampling models finish)",
        doc="let JSON constraints (`response_format`; `structured_outputs` json without `disable_any_whitespace` "
        "or `whitespace_pattern`) put free whitespace between tokens; unset: compact JSON, as tool calls are, "
        "because a sampling model otherwise fills `max_tokens` with newlines and spaces and never closes the "
        "document ([Structured outputs](structured_outputs.md#compact-json))",
    )  # fmt: skip
    stream_stall_timeout: float | None = option(
        DEFAULT_STREAM_STALL_TIMEOUT_S, surfaces=(SERVE,), group=SERVER_GROUP, unit=SECONDS, metavar="SECONDS",
        help="abort a streamed request whose client reads nothing for this long, freeing its KV blocks "
        f"(0 = never; default: {DEFAULT_STREAM_STALL_TIMEOUT_S:g})",
        doc="seconds a streamed response waits for its client to read before its requests are aborted and their "
        "KV blocks freed (`sse_response`; `0` or `None`: wait for ever; [Slow readers](serving.md#slow-readers))",
    )  # fmt: skip

    @property
    def discloses_prefix_hits(self) -> bool:
        """Whether callers may read prefix-cache hits in the stats, the block grid and the
        metrics. Each switch hands a caller hit counts (its own, or every request's), so with any
        of them on, hiding the aggregate counters would protect nothing."""
        return self.enable_prompt_tokens_details or self.cache_stats_per_request or self.enable_cache_stats_disclosure
