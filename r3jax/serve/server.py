"""``python -m r3jax serve``: the inference server under uvicorn.

    python -m r3jax serve --model tiny --host 127.0.0.1 --port 8000 [--api-key KEY]
        [--max-batch-size 32] [--max-seq-len 256] [--seed 0] [--config PRESET|HF_DIR]
        [--block-size 16] [--prefill-chunk 64] [--max-num-batched-tokens N] [--num-pages N] [--decode-buckets 3]
        [--mixed-decode-buckets 1] [--tensor-parallel-size T] [--data-parallel-size D] [--enable-expert-parallel]
        [--mesh DATA,TENSOR,EXPERT]
        [--compilation-cache DIR] [--static] [--tokenizer auto|byte|none|FILE] [--served-model-name NAME]
        [--enable-return-routed-experts]

``--model``: a preset (``tiny``), a Hugging Face directory or an orbax params directory (see
:mod:`r3jax.serve.weights`). Binds to loopback unless ``--host`` says otherwise. ``--port 0`` picks a
free port. Prints ``r3jax serve: listening on http://HOST:PORT`` once the socket is bound; then every
device program is compiled (``/health`` answers 503 ``{"status": "warming_up"}`` until it is done, then
200) and ``r3jax serve: warm-up built N programs in S s (C compiled, L from the compilation cache)`` is
logged. ``--compilation-cache DIR`` keeps compiled programs in JAX's persistent cache and the engine's
own serialized programs in ``DIR/r3jax-programs`` (:mod:`r3jax.engine.program_cache`), so a restart
loads them without tracing, lowering or compiling. ``--static`` serves the
old way (a batch is admitted only when every slot is free, and decodes to completion), for comparisons.

**Devices.** The devices form a ``(data, tensor, expert)`` mesh: ``data`` engine cores
(:class:`r3jax.engine.group.EngineGroup`: each core an engine on its own ``tensor x expert`` devices,
with its own weights, page pool and scheduler; a request lives on one core, so tokens/s adds up over
``data``), each core's attention heads, dense MLP and each expert's hidden dim along ``tensor`` and
experts along ``expert`` (:mod:`r3jax.engine.sharding`). Give it as ``--mesh DATA,TENSOR,EXPERT``, or with vLLM's flags:
``--tensor-parallel-size T --data-parallel-size D`` is the mesh ``(D, T, 1)``; adding
``--enable-expert-parallel`` spreads the expert weights over all ``D x T`` devices as vLLM's expert
parallelism does (its EP size is ``D x T``): the mesh becomes ``(1, T, D)``, experts split over the
``D`` groups and each expert's hidden dim over the ``T`` devices of a group, attention still over ``T``
(one core whose experts spread over every device, instead of D cores each holding every expert). The
sizes must multiply to at most the local device count (the first ones are used). Default: every
local device along ``data`` on an accelerator (one core per device), one device on CPU. ``/v1/stats``
reports the mesh (``"mesh": {"data", "tensor", "expert", "devices", "engine_cores",
"expert_parallel"}``) and, with several cores, each core's counters (``engine.cores``). A mesh that
would hold an array whole on several devices (kv heads that ``tensor`` does not divide; an MLA latent
page pool, which has no head axis, with ``tensor`` > 1) is refused at start naming the array and the
multiplier, unless ``--allow-replication`` (one warning).

SIGTERM / SIGINT: uvicorn stops accepting connections, lets in-flight requests finish (up to
``--graceful-timeout`` seconds), then the app refuses anything still queued with 503 (clients retry
it elsewhere) and exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time


# r3jax.engine.Engine's defaults (not imported here: --help must not start JAX; a test checks they agree)
ENGINE_DEFAULTS = dict(block_size=16, prefill_chunk=64, decode_steps=8, decode_buckets=3, mixed_decode_buckets=1)
ENGINE_DEFAULT_PREFILL_ROWS = 16


def parse_args(argv: list[str], devices=None) -> argparse.Namespace:
    """The server's flags. ``devices``: the local devices the mesh flags are checked against
    (default: ``jax.local_devices()``)."""
    ap = argparse.ArgumentParser(prog="python -m r3jax serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="preset name, Hugging Face dir or orbax params dir")
    ap.add_argument("--config", default=None, help="config for an orbax --model: preset or HF dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("R3JAX_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $R3JAX_API_KEY)")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20)
    ap.add_argument("--seed", type=int, default=0, help="init seed of a preset model")
    ap.add_argument("--prefix-cache-mb", type=float, default=64.0,
                    help="device memory for the engine's prefix cache (0 turns it off)")
    ap.add_argument("--compilation-cache", default=None, metavar="DIR",
                    help="JAX persistent compilation cache directory (a restart reuses compiled programs)")
    eng = ap.add_argument_group("engine", "the paged KV + route pool and the step budget (r3jax.engine.Engine)")
    eng.add_argument("--block-size", type=int, default=ENGINE_DEFAULTS["block_size"], help="tokens per page")
    eng.add_argument("--decode-steps", type=int, default=ENGINE_DEFAULTS["decode_steps"],
                     help="decode steps per device call while no prompt is being prefilled (stop tokens and "
                          "max_tokens checked on device); a prompt arriving meanwhile waits for the call")
    eng.add_argument("--prefill-chunk", type=int, default=ENGINE_DEFAULTS["prefill_chunk"],
                     help="prompt tokens per prefill row (a long prompt takes several rows, over several steps)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="tokens per step: --max-batch-size decode rows + whole prefill chunks (default: "
                          f"--max-batch-size + {ENGINE_DEFAULT_PREFILL_ROWS} x --prefill-chunk, or 4 x with "
                          "--max-batch-size < 12)")
    eng.add_argument("--num-pages", type=int, default=None,
                     help="pages in the pool (default: --max-batch-size full sequences + --prefix-cache-mb)")
    eng.add_argument("--decode-buckets", type=int, default=ENGINE_DEFAULTS["decode_buckets"],
                     help="decode-row sizes with a decode program: B, B/2, B/4, ... (1: every decode call padded "
                          "to --max-batch-size rows)")
    eng.add_argument("--mixed-decode-buckets", type=int, default=ENGINE_DEFAULTS["mixed_decode_buckets"],
                     help="how many of those sizes (largest first) also get the 2 programs of steps that prefill "
                          "(default 1: a step that prefills pads its decode rows to --max-batch-size)")
    par = ap.add_argument_group("devices", "the (data, tensor, expert) mesh: --mesh, or vLLM's flags (not both)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                     help="devices along tensor (attention heads, MLP and expert hidden dims)")
    par.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                     help="engine cores, each on its own TP devices (requests split over them)")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="split the experts over the data-parallel devices: mesh (1, TP, DP)")
    par.add_argument("--mesh", default=None, metavar="DATA,TENSOR,EXPERT",
                     help="the mesh sizes (default: every local device along data on an accelerator, "
                          "one device on CPU)")
    par.add_argument("--allow-replication", action="store_true",
                     help="serve on a mesh that leaves an array whole on several devices (an MLA latent page "
                          "pool over tensor, kv heads that tensor does not divide): one warning instead of "
                          "an error")
    ap.add_argument("--static", action="store_true",
                    help="admit a batch only when every slot is free (the old static batching; for benchmarks)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="param and compute dtype (default: the checkpoint's / preset's)")
    ap.add_argument("--router-noise", type=float, default=None,
                    help="std of simulated selection noise on the router logits (a train-rollout mismatch knob "
                         "for experiments: Engine(router_noise=...)); default: the model's (0)")
    ap.add_argument("--logits-dot-in-fp32", action=argparse.BooleanOptionalAction, default=True,
                    help="the LM head in fp32 whatever --dtype (default on: bf16 logprobs without the head's own "
                         "bf16 rounding); --no-logits-dot-in-fp32 computes it in --dtype")
    ap.add_argument("--served-model-name", default=None,
                    help="the model name vLLM-style endpoints report and accept (default: --model)")
    ap.add_argument("--tokenizer", default="auto",
                    help="'byte' (r3jax.rollout.ByteTokenizer), a tokenizer.json path, 'none', or 'auto': "
                         "byte for a preset with its 272-token vocabulary, the model directory's tokenizer.json "
                         "if there is one, else none (text prompts and /tokenize are then a 400)")
    ap.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                    help="vLLM's flag: read <tool_call>{json}</tool_call> blocks of chat replies into message.tool_calls")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="vLLM's flag: /v1/completions returns routed experts unless a body says otherwise")
    ap.add_argument("--graceful-timeout", type=float, default=30.0)
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    for name in ("max_batch_size", "max_seq_len", "max_body_bytes", "block_size", "prefill_chunk", "decode_steps",
                 "max_num_batched_tokens", "num_pages", "tensor_parallel_size", "data_parallel_size",
                 "decode_buckets", "mixed_decode_buckets"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if not 0 <= args.port < 65536:
        ap.error(f"--port={args.port}: expected 0..65535")
    if args.prefix_cache_mb < 0:
        ap.error(f"--prefix-cache-mb={args.prefix_cache_mb}: expected >= 0")
    least = args.max_batch_size + args.prefill_chunk
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < least:
        ap.error(f"--max-num-batched-tokens={args.max_num_batched_tokens}: expected >= --max-batch-size + "
                 f"--prefill-chunk = {least} (every decode row and one prefill chunk per step)")
    pages = 1 + -(-args.max_seq_len // args.block_size)
    if args.num_pages is not None and args.num_pages < pages:
        ap.error(f"--num-pages={args.num_pages}: expected >= {pages} (the trash page + one sequence of "
                 f"--max-seq-len={args.max_seq_len} in --block-size={args.block_size} pages)")
    if devices is None:
        import jax

        devices = jax.local_devices()
    try:
        args.mesh_shape = mesh_shape(args, len(devices), devices[0].platform)
    except ValueError as e:
        ap.error(str(e))
    return args


def _mesh_flag(value: str) -> tuple[int, int, int]:
    """``--mesh DATA,TENSOR,EXPERT`` -> three ints >= 1."""
    parts = value.split(",")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 1:
        raise ValueError(f"--mesh={value!r}: expected DATA,TENSOR,EXPERT, three ints >= 1 (e.g. 2,2,2)")
    return sizes


def mesh_shape(args: argparse.Namespace, num_devices: int, platform: str) -> tuple[int, int, int]:
    """The ``(data, tensor, expert)`` sizes the flags ask for, on ``num_devices`` local devices of
    ``platform`` (see the module docstring). Raises ValueError naming the flag, its value and what
    was expected."""
    vllm = [f"--{n}" for n, v in (("tensor-parallel-size", args.tensor_parallel_size),
                                  ("data-parallel-size", args.data_parallel_size),
                                  ("enable-expert-parallel", args.enable_expert_parallel or None)) if v is not None]
    if args.mesh is not None:
        if vllm:
            raise ValueError(f"--mesh={args.mesh!r} and {' '.join(vllm)}: expected one of them (--mesh gives "
                             "every axis; the vLLM flags are its other spelling)")
        shape, named = _mesh_flag(args.mesh), f"--mesh={args.mesh}"
    elif vllm:
        t, d = args.tensor_parallel_size or 1, args.data_parallel_size or 1
        shape = (1, t, d) if args.enable_expert_parallel else (d, t, 1)
        named = f"--tensor-parallel-size={t} x --data-parallel-size={d}"
    else:  # the default: the whole accelerator, or one CPU device (simulated CPU devices share the cores)
        return (1, 1, 1) if platform == "cpu" else (num_devices, 1, 1)
    n = shape[0] * shape[1] * shape[2]
    if n > num_devices:
        raise ValueError(f"{named}: {n} devices, expected at most the {num_devices} local {platform} device(s)")
    return shape


def build_engine(args: argparse.Namespace, devices=None):
    """The server's engine: an :class:`r3jax.engine.Engine` on the ``(1, tensor, expert)`` mesh of the
    flags, or with ``data`` > 1 an :class:`r3jax.engine.group.EngineGroup` of ``data`` such engines
    (``--max-batch-size`` and ``--num-pages`` are per core)."""
    import jax
    import jax.numpy as jnp

    from r3jax.engine import Engine
    from r3jax.engine.group import EngineGroup
    from r3jax.serve.weights import build_model

    dtype = None if args.dtype is None else getattr(jnp, args.dtype)
    model = build_model(args.model, config=args.config, seed=args.seed, dtype=dtype)
    kw = dict(max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size,
              prefix_cache_bytes=int(args.prefix_cache_mb * (1 << 20)), block_size=args.block_size,
              prefill_chunk=args.prefill_chunk, max_num_batched_tokens=args.max_num_batched_tokens,
              num_pages=args.num_pages, decode_buckets=args.decode_buckets, decode_steps=args.decode_steps,
              mixed_decode_buckets=args.mixed_decode_buckets, static=args.static,
              logits_dot_in_fp32=args.logits_dot_in_fp32, router_noise=args.router_noise,
              allow_replication=args.allow_replication,
              program_cache=None if args.compilation_cache is None else os.path.join(args.compilation_cache,
                                                                                       "r3jax-programs"))
    data, tensor, expert = args.mesh_shape
    if data > 1:
        devices = list(jax.local_devices() if devices is None else devices)
        return EngineGroup(model, data=data, tensor=tensor, expert=expert, devices=devices, seed=args.seed, **kw)
    return Engine(model, mesh=build_mesh(args.mesh_shape, devices), **kw)


def build_mesh(shape: tuple[int, int, int], devices=None):
    """The engine's mesh of ``(data, tensor, expert)`` sizes over the first local devices, or None
    for one device (the engine's single-device placement)."""
    import math

    import jax

    from r3jax.engine.sharding import make_mesh

    n = math.prod(shape)
    if n == 1:
        return None
    devices = list(jax.local_devices() if devices is None else devices)[:n]
    return make_mesh(*shape, devices=devices)


def build_tokenizer(spec: str, model: str, vocab_size: int):
    """The server's tokenizer for ``--tokenizer`` (see ``--help``), or None."""
    from pathlib import Path

    from r3jax.rollout.tokenizer import ByteTokenizer

    path = Path(model) / "tokenizer.json" if spec == "auto" else Path(spec)
    if spec == "none":
        return None
    if spec == "byte" or (spec == "auto" and not Path(model).exists() and vocab_size == ByteTokenizer.vocab_size):
        return ByteTokenizer()
    if spec == "auto" and not path.is_file():
        return None
    if not path.is_file():
        raise ValueError(f"--tokenizer={spec!r}: expected 'auto', 'byte', 'none' or a tokenizer.json file")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"--tokenizer={spec!r}: reading tokenizer.json needs the 'tokenizers' package") from None
    return _HFText(Tokenizer.from_file(str(path)), _chat_config(path.with_name("tokenizer_config.json")))


def _chat_config(path) -> dict:
    """``chat_template``, ``bos_token`` and ``eos_token`` of a tokenizer_config.json (empty when absent)."""
    import json

    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    name = lambda v: v.get("content") if isinstance(v, dict) else v
    template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        return {}
    return {"template": template, "bos_token": name(cfg.get("bos_token")), "eos_token": name(cfg.get("eos_token"))}


class _HFText:
    """A Hugging Face ``tokenizers.Tokenizer`` as the server's text codec (no special tokens added),
    and its chat renderer (``chat_ids``) when the model directory's tokenizer_config.json has a
    ``chat_template``. Serving chat needs no prefix-stable template: each request is rendered whole."""

    def __init__(self, tok, chat: dict | None = None):
        from r3jax.rollout.tokenizer import compile_template

        self.tok = tok
        chat = chat or {}
        self._template = compile_template(chat["template"]) if chat.get("template") else None
        self._bos, self._eos = chat.get("bos_token"), chat.get("eos_token")
        # a template that reads `tools` renders tool definitions and assistant tool calls
        self.supports_tools = self._template is not None and "tools" in chat["template"]
        if self._template is not None:
            self.chat_ids = self._chat_ids

    def _chat_ids(self, messages, tools: list | None = None) -> list[int]:
        from r3jax.rollout.tokenizer import render_chat

        return self.encode(render_chat(self._template, list(messages), True, bos_token=self._bos, eos_token=self._eos,
                                       tools=tools))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def use_compilation_cache(directory: str) -> None:
    """Keep every compiled program in JAX's persistent cache under ``directory`` (any size, any
    compile time), so a restarted server loads its programs instead of compiling them."""
    import jax

    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def serve(app, sock: socket.socket, *, log_level: str = "warning", graceful_timeout: float = 30.0):
    """Run ``app`` under uvicorn on an already bound socket until SIGTERM/SIGINT."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_timeout,
                            access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def process_age() -> float:
    """Seconds since this process started (Linux ``/proc``; elsewhere 0: counted from here on)."""
    try:
        start_ticks = float(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter() - process_age()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from r3jax.serve.app import create_app

    if args.compilation_cache is not None:
        use_compilation_cache(args.compilation_cache)
    # The engine thread hands the GIL to the event loop around every device call; with the default 5 ms
    # switch interval each hand-back can wait that long while HTTP work runs, stalling every slot.
    sys.setswitchinterval(0.0005)
    try:
        engine = build_engine(args)
        tokenizer = build_tokenizer(args.tokenizer, args.model, engine.config.vocab_size)
    except (ValueError, FileNotFoundError) as e:  # a bad --model / --config / mesh: say so, no traceback
        from models.axes import ReplicationError

        hint = ""
        if isinstance(e, ReplicationError):  # the model's shapes do not divide over the mesh asked for
            data, tensor, expert = args.mesh_shape
            hint = (f" (mesh data={data}, tensor={tensor}, expert={expert} from --mesh / --tensor-parallel-size"
                    " / --data-parallel-size / --enable-expert-parallel: pick sizes that divide the model's, or "
                    "--allow-replication)")
        raise SystemExit(f"python -m r3jax serve: {e}{hint}") from None
    app = create_app(engine, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     served_model_name=args.served_model_name or args.model, tokenizer=tokenizer,
                     return_routed_experts_default=args.enable_return_routed_experts, started_at=started,
                     tool_call_parser=args.tool_call_parser)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, restores these handlers and re-raises the
    # signal: exit 0 then, instead of dying by the signal after a clean shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    print(f"r3jax serve: listening on http://{host}:{port}", flush=True)
    serve(app, sock, log_level=args.log_level, graceful_timeout=args.graceful_timeout)
