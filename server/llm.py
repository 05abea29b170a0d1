"""Offline Python API, in the shape of vLLM's `LLM`.

    from eagle_serve.server.llm import LLM
    from eagle_serve.engine.sampling_params import SamplingParams
    llm = LLM()  # the embedded default model
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence as Seq

from eagle_serve.engine.config import EngineConfig
from eagle_serve.engine.model_runner import ModelRunner
from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.scheduler.block_allocator import BlockAllocator
from eagle_serve.scheduler.loop import EngineLoop
from eagle_serve.scheduler.output_processor import RequestOutput
from eagle_serve.scheduler.scheduler import SchedulerConfig
from eagle_serve.scheduler.worker import on_engine_thread
from eagle_serve.server.generation_config import load_defaults

Prompt = str | list[int]

log = logging.getLogger("eagle_serve")


class LLM:
    def __init__(self, model: str | None = None, *, generation_config: str = "auto",
                 budget_overrides: dict | None = None, profile_context: int | None = None,
                 chat_template: str | None = None, **engine_kwargs):
        """Built on the process's engine thread (scheduler.worker), where its steps run too.
        `generation_config`: where sampling defaults come from, as vLLM's (auto: the model's
        generation_config.json; vllm: neutral; or a path), see server/generation_config.py.
        `budget_overrides`: `BudgetConfig` fields that differ from the served defaults;
        `profile_context`: committed tokens per sequence in the start-up cost profile (None: the
        profile's default). Both only apply where the tree budget runs. `chat_template`: a template
        file or a shipped template's name (`chatml_tools`) that replaces the model's chat template
        (server/chat_templates.py)."""
        from eagle_serve.server.chat_templates import load_chat_template
        if chat_template is not None and engine_kwargs.get("skip_tokenizer"):
            raise ValueError("chat_template needs a tokenizer (this LLM is built with skip_tokenizer=True)")
        self._chat_template = None if chat_template is None else load_chat_template(chat_template)
        self.engine_config = EngineConfig(model=model, **engine_kwargs)
        self.generation_defaults = load_defaults(generation_config, model or "", model in (None, "", "default"))
        self._budget_overrides = dict(budget_overrides or {})
        self._profile_context = profile_context
        on_engine_thread(self._build)
        log.info("sampling defaults from %s", self.generation_defaults.describe())

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request that sets nothing samples with: the generation config's values, else
        SamplingParams' own (as vLLM's LLM.get_default_sampling_params)."""
        d = self.generation_defaults
        values = {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "max_tokens": d.max_new_tokens}
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})

    def _build(self) -> None:
        start = time.perf_counter()
        log.info("start-up: loading %s: weights and KV cache%s",
                 self.engine_config.model or "the embedded default model",
                 ", and the draft head" if self.engine_config.spec.uses_head else "")
        self.runner = ModelRunner(self.engine_config)
        log.info("start-up: model loaded in %.1f s", time.perf_counter() - start)
        loaded = self.runner.loaded
        self.tokenizer = loaded.tokenizer
        if self._chat_template is not None and self.tokenizer is not None:
            # a copy: the loaded tokenizer may be shared, and keeps the model's own template
            self.tokenizer = dataclasses.replace(self.tokenizer, chat_template=self._chat_template, template_names=())
        self.model_name = loaded.name
        c = self.engine_config
        self.allocator = BlockAllocator(self.runner.num_blocks, c.block_size, c.enable_prefix_caching)
        sched = SchedulerConfig(max_model_len=self.runner.max_model_len, max_num_seqs=c.max_num_seqs,
                                max_num_batched_tokens=c.max_num_batched_tokens,
                                max_prefill_chunk=min(c.max_prefill_chunk, c.max_num_batched_tokens))
        spec = c.spec
        self.budget = None
        self.cost_profiles = None  # the tree budget's cost profiles (scheduler.budget.CostProfiles)
        if spec.method != "none" and c.tree_budget:
            from eagle_serve.scheduler.budget import BudgetConfig, TreeBudget
            start = time.perf_counter()
            log.info("start-up: tree budget cost profile (the load-aware tree budget sizes each round's "
                     "draft tree from the step costs it measures)")
            prof = self._start_cost_profiles()
            log.info("start-up: tree budget cost profile done in %.1f s", time.perf_counter() - start)
            self.budget = TreeBudget(self._costs(prof), BudgetConfig(
                spec.tree_tokens, max_depth=spec.max_depth if spec.dynamic_tree else None,
                **self._budget_overrides))
        self.loop = EngineLoop(self.runner, self.tokenizer, self.allocator, sched,
                               loaded.eos_token_ids, loaded.config.vocab_size,
                               spec_tokens=spec.max_depth + 1, spec_slots=spec.scratch_slots, budget=self.budget,
                               idle_work=self.cost_profiles, tree_tokens=spec.tree_tokens)

    # ------------------------------------------------------------------ the tree budget's cost profile
    def _start_cost_profiles(self) -> dict:
        """The start-up cost profile: read from the on-disk cache when this engine on this
        machine was profiled before (engine/profile_cache.py), else measured and stored if clean.
        A later clean idle-time profile replaces the stored one."""
        from eagle_serve.engine import profile_cache
        from eagle_serve.engine.profile import extend, profile_costs
        from eagle_serve.scheduler.budget import CostProfiles
        args = self._profile_args()
        key = profile_cache.profile_key(self.runner, **args)

        def adopt(prof: dict) -> None:
            self.budget.set_costs(self._costs(prof))
            profile_cache.store(key, prof)

        self.cost_profiles = CostProfiles(self._start_idle_profile, extend, adopt, self.allocator)
        prof = profile_cache.load(key)
        if prof is not None:
            log.info("tree budget cost profile: read from the cache")
        else:
            prof = profile_costs(self.runner, **args)
            profile_cache.store(key, prof)
        return self.cost_profiles.record(prof)

    @property
    def cost_profile(self) -> dict | None:
        """The profile the tree budget's costs came from (None without a budget)."""
        return None if self.cost_profiles is None else self.cost_profiles.current

    def _costs(self, prof: dict):
        from eagle_serve.scheduler.budget import CostModel
        # eagle2's / eagle3's dynamic tree is sized and cut to depth per round; the other drafters'
        # rounds cost what the profile measured, whatever their size
        per_level = self.engine_config.spec.dynamic_tree
        return CostModel(prof["verify"], prof["draft"], prof["draft_first"] if per_level else [], depth=prof["depth"])

    def _profile_args(self) -> dict:
        """What every cost profile of this engine measures, the start-up one and the idle-time
        ones alike, so that their curves join."""
        c = self.engine_config
        return dict(max_tokens=c.max_num_batched_tokens, max_seqs=c.max_num_seqs, context=self._profile_context)

    def _start_idle_profile(self):
        from eagle_serve.engine.profile import ProfileRun
        return ProfileRun(self.runner, **self._profile_args(), full_context=True)

    def _finish_idle(self) -> None:
        """The synchronous front end's idle time is before a call: run due idle work (an
        unfinished profile to its end) before the call's requests."""
        if self.loop.idle_due():
            on_engine_thread(self.loop.run_idle)
            while self.cost_profiles is not None and self.cost_profiles.under_way and self.loop.idle_due():
                on_engine_thread(self.loop.run_idle)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: a string (tokenized), a list of token ids, or vLLM's prompt dicts
        {"prompt": str} / {"prompt_token_ids": list[int]}."""
        if isinstance(prompt, dict):
            if len(prompt) != 1 or not ({"prompt", "prompt_token_ids"} & prompt.keys()):
                raise ValueError(f"a prompt dict takes one key, 'prompt' or 'prompt_token_ids'; got {sorted(prompt)}")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this LLM was built with skip_tokenizer=True; pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in prompt order. `sampling_params`
        is vLLM's name for `params` (give one of them).

        The call's requests are added and run as one unit on the engine thread, which runs one
        unit at a time: calls from several threads queue there and each gets its own outputs (an
        LLM that an AsyncEngine is serving is not for generate: the unit's steps would take the
        server's outputs). If the call ends early (Ctrl-C while it waits, an error in the engine
        loop), its requests are aborted and their KV blocks freed, so the next call starts clean."""
        if sampling_params is not None:
            if params is not None:
                raise ValueError("give params or sampling_params, not both")
            params = sampling_params
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling params must be SamplingParams")
        for p in {p.structured for p in params} - {None}:  # compiled here: a bad grammar is this call's ValueError
            self.runner.grammars.get(p)
        encoded = [self.encode(p) for p in prompts]
        cancel = threading.Event()
        try:
            outs = on_engine_thread(self._run, encoded, params, cancel)
        except BaseException:
            cancel.set()  # the unit, if still queued or running, aborts its requests at its next step
            raise
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outs)} requests failed in the engine; first: {failed[0].error}")
        return outs

    def _run(self, encoded: list[list[int]], params: list[SamplingParams], cancel: threading.Event) -> list[RequestOutput]:
        """On the engine thread: due idle work first, then add the requests (all or nothing) and
        step until each is done."""
        if cancel.is_set():  # interrupted while queued behind another call
            raise KeyboardInterrupt("interrupted")
        self._finish_idle()
        seqs = []
        try:
            for ids, p in zip(encoded, params):
                seqs.append(self.loop.add_request(ids, p))
            final = self.loop.run_to_completion({s.seq_id for s in seqs}, cancel)
            return [final[s.seq_id] for s in seqs]
        except BaseException:
            for s in seqs:  # abort is a no-op for a request that finished
                try:
                    self.loop.abort(s.seq_id)
                except Exception:  # noqa: BLE001 - the others are still freed; the first error goes up
                    log.exception("aborting request %d after an interrupted generate failed", s.seq_id)
            raise

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None, *,
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or several (a
        list of such lists), then generate. A message is {"role", "content"}, its content a
        string or a list of text parts ({"type": "text", "text": ...}, joined by newlines, as the
        server joins them); assistant messages may carry OpenAI's tool_calls and tool messages
        a tool_call_id. `tools`: OpenAI's tool list, passed to the template (which must render
        it: see `chat_template`)."""
        if self.tokenizer is None:
            raise ValueError("this LLM was built with skip_tokenizer=True; chat needs a tokenizer")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = []
        for c in conversations:
            messages = _messages(c)
            from eagle_serve.server.chat_templates import check_template_tools
            from eagle_serve.server.protocol import ApiError
            try:
                check_template_tools(self.tokenizer.chat_template, tools, messages)
            except ApiError:
                raise ValueError("this model's chat template does not render tools or tool calls; build the "
                                 "LLM with chat_template='chatml_tools' (ChatML models) or a template file") from None
            prompts.append(self.tokenizer.encode_chat(messages, tools=tools))
        return self.generate(prompts, params, sampling_params=sampling_params)


def _messages(conversation) -> list[dict]:
    """One conversation's messages for the chat template, checked as the server checks them."""
    from pydantic import ValidationError

    from eagle_serve.server.protocol import message_adapter, template_message
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"a conversation is a non-empty list of messages, got {conversation!r}")
    out = []
    for m in conversation:
        try:
            out.append(template_message(message_adapter.validate_python(m)))
        except ValidationError as e:
            raise ValueError(f"invalid message {m!r}: {e.errors()[0]['msg']}") from None
    return out
