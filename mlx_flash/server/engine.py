"""The worker that owns the model: one request at a time, in arrival order.

A Job carries a CompletionRequest in and events out (a thread-safe queue): one `Start`
(the prompt's token count) or one `Failed`, then `Piece`s of text with their tokens'
log-probabilities, then one `Done`. The HTTP handler may set `job.cancel` (the client
went away); the worker stops at the next token.

Prompt caching: the KV cache of the last request stays (prompt_cache.PromptCache), tagged
with the request's owner (the HTTP side's client identity, or "shared" when the operator
shares it); the next request of the same owner that continues it feeds only what is new.
A request of another owner starts from a fresh cache: it learns nothing of another client's
prompt, from `cached_tokens` or from its own timing.

Bounded work: the prompt is fed in chunks, and between chunks and between tokens the worker
checks whether the client left and whether the request ran past its time
(Limits.request_timeout). After any failure MLX's random state is seeded afresh: a sampler
that raised inside a compiled function leaves it unusable for every later request.
"""

import os
import queue
import threading
import time
from dataclasses import dataclass, field

from ..errors import FlashError, ModelFileError
from ..generate import context_overflow
from .requests import CHAT, TEXT, RequestError

PREFILL_CHUNK = 512  # prompt tokens fed between two checks for a client gone or a request past its time


@dataclass
class Start:
    prompt_tokens: int
    cached_tokens: int  # of them, served from the kept KV cache


@dataclass
class Piece:
    text: str
    tokens: list = field(default_factory=list)  # [(id, text, logprob, [(id, text, logprob), ...])]


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    seconds: float


@dataclass
class Failed:
    error: RequestError


def _reseed():
    """MLX's random state seeded from the OS: no request's samples follow from another's seed."""
    import mlx.core as mx

    mx.random.seed(int.from_bytes(os.urandom(8), "little"))


class Stopped(Exception):
    """Raised between prompt chunks: the client left ("cancelled") or time ran out ("timeout")."""

    def __init__(self, why):
        super().__init__(why)
        self.why = why


class Job:
    def __init__(self, request):
        self.request = request
        self.events = queue.Queue()
        self.cancel = threading.Event()
        self.finished = False  # its Done or Failed was taken (by the HTTP handler)
        self.started = False  # its Start was sent: an error after it is not the request's fault
        self.deadline = None  # time.monotonic() past which it stops (set when it starts)

    def stop_reason(self):
        """"cancelled", "timeout" or None: whether the worker should stop serving it now."""
        if self.cancel.is_set():
            return "cancelled"
        if self.deadline is not None and time.monotonic() > self.deadline:
            return "timeout"
        return None


class StopText:
    """Holds back text that may be the start of a stop string; finds the first stop."""

    def __init__(self, stops):
        self.stops, self.text, self.sent = stops, "", 0

    def add(self, segment):
        """-> (text that is safe to send now, True when a stop string was reached)."""
        self.text += segment
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        hits = [i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out, self.sent = self.text[self.sent:end], max(end, self.sent)
            return out, True
        hold = 0  # the longest tail of the text that begins a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def rest(self):
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class ContinuationText:
    """The text of generated tokens as a continuation of the prompt: mlx_lm's streaming
    detokenizers drop the first token's leading space (right for a chat answer, wrong for a
    completion, whose text is appended to the prompt). Decodes the tokens since an anchor
    (one token kept before them as context, its own text cut off) and sends what is new,
    holding back an incomplete UTF-8 character; the anchor moves every ANCHOR_EVERY tokens,
    so a token costs a decode of a few dozen tokens, not of the whole answer."""

    ANCHOR_EVERY = 32

    def __init__(self, tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.base, self.prefix, self.sent = 0, "", 0  # ids[base:] decoded, minus `prefix` (ids[base]'s text)

    def _text(self):
        return self.tokenizer.decode(self.ids[self.base:], clean_up_tokenization_spaces=False)[len(self.prefix):]

    def add(self, token):
        self.ids.append(token)
        text = self._text()
        if text.endswith("\ufffd"):
            return ""
        out, self.sent = text[self.sent:], len(text)
        if len(self.ids) - self.base > self.ANCHOR_EVERY:
            last = self.tokenizer.decode(self.ids[-1:], clean_up_tokenization_spaces=False)
            if "\ufffd" not in last:  # (a token that completes a character is no anchor)
                self.base, self.prefix, self.sent = len(self.ids) - 1, last, 0
        return out

    def rest(self):
        """At the end: what was held back (an incomplete character is sent as it decodes)."""
        text = self._text()
        out, self.sent = text[self.sent:], len(text)
        return out


class Engine:
    """Loads nothing itself: give it a loaded model and tokenizer (mlx_flash.load)."""

    def __init__(self, model, tokenizer, limits, log=None, draft=None, num_draft_tokens=3):
        from ..generate import draft_ahead
        from ..prompt_cache import PromptCache

        self.draft = {} if draft is None else {"draft_model": draft.model, "num_draft_tokens": num_draft_tokens}
        self.ahead = draft_ahead(self.draft)
        self.model, self.tokenizer, self.limits = model, tokenizer, limits
        self.vocab = model.args.vocab_size  # the logits' width: token ids and logit_bias keys below it
        self.log = log or (lambda msg: None)
        self.jobs = queue.Queue()
        self.waiting = 0  # jobs queued, not yet started
        self.lock = threading.Lock()
        self.kept = PromptCache(model, draft)
        self.kept_owner = None  # whose request left the kept cache
        self.damaged = None  # a model file that failed a read while serving: /health says so
        if not self.kept.trimmable:
            self.log("prompt caching: this KV cache kind cannot be trimmed; a request reuses the kept cache "
                     "only when the cache holds a prefix of its prompt exactly")
        self.served = 0  # requests finished (answered, refused or cancelled)
        self.cancelled = 0  # of them, stopped because their client went away
        self.thread = None
        self.current = None  # the job being served

    # -- the queue ------------------------------------------------------------------------------
    def submit(self, request):
        """A Job in the queue, or RequestError 429 when the queue is full."""
        with self.lock:
            if self.waiting >= self.limits.queue_size:
                raise RequestError(f"the server is busy: {self.waiting} requests are waiting "
                                   f"(--queue-size {self.limits.queue_size}); retry later", status=429,
                                   code="queue_full")
            self.waiting += 1
        job = Job(request)
        self.jobs.put(job)
        return job

    def alive(self):
        return self.thread is not None and self.thread.is_alive()

    def start(self):
        self.thread = threading.Thread(target=self._loop, name="mlx_flash-engine", daemon=True)
        self.thread.start()

    def stop(self):
        """End the worker: the request being served stops at its next token."""
        job = self.current
        if job is not None:
            job.cancel.set()
        self.jobs.put(None)
        if self.thread is not None:
            self.thread.join(timeout=30)

    def _loop(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self.lock:
                self.waiting -= 1
            if job.cancel.is_set():
                self.served, self.cancelled = self.served + 1, self.cancelled + 1
                job.events.put(Done("cancelled", 0, 0, 0.0))
                continue
            self.current = job
            try:
                self.serve(job)
            except RequestError as e:  # (raised before the kept cache is touched)
                job.events.put(Failed(e))
            except Stopped as e:  # during the prompt
                self.kept.reset()
                if e.why == "cancelled":
                    self.cancelled += 1
                    job.events.put(Done("cancelled", 0, 0, 0.0))
                else:
                    self.log(f"a request ran past --request-timeout {self.limits.request_timeout:g} s in its prompt")
                    job.events.put(Failed(RequestError(
                        f"the request ran past this server's --request-timeout ({self.limits.request_timeout:g} s) "
                        "while reading its prompt", status=503, code="request_timeout")))
            except ModelFileError as e:  # a model file failed: the server's fault, and not this request's alone
                self._fresh_state()
                self.damaged = str(e)
                self.log(f"error: {e}")
                job.events.put(Failed(RequestError(f"a model file failed a read: {e}", status=500,
                                                   code="model_damaged")))
            except FlashError as e:  # before the first token: the request's (its context); after: the server's
                self._fresh_state()
                job.events.put(Failed(RequestError(str(e), status=500 if job.started else 400)))
            except Exception as e:  # a bug: answer 500, keep serving
                self._fresh_state()
                self.log(f"error: {type(e).__name__}: {e}")
                job.events.put(Failed(RequestError(f"internal error: {type(e).__name__}: {e}", status=500)))
            finally:
                self.current = None
                self.served += 1
                if self.jobs.empty():
                    import mlx.core as mx

                    mx.clear_cache()  # give MLX's buffer cache back while idle

    def _fresh_state(self):
        """After a failure: drop the kept cache, and seed MLX's random state afresh (a sampler
        that raised inside mlx_lm's compiled function leaves the state without a value, and
        every later sampled request would fail)."""
        self.kept.reset()
        _reseed()

    # -- one request ----------------------------------------------------------------------------
    def check_sampling(self, req):
        """The request's sampling fields against the model: RequestError before any work."""
        if req.top_k >= self.vocab:
            raise RequestError(f"'top_k' {req.top_k} must be below the vocabulary's {self.vocab} tokens "
                               "(0: no top-k)", param="top_k")

    def prompt_tokens(self, req):
        tok = self.tokenizer
        if req.kind == CHAT:
            if getattr(tok, "chat_template", None) is None:
                raise RequestError("this model has no chat template: use /v1/completions")
            try:
                ids = tok.apply_chat_template(req.messages, add_generation_prompt=True)
            except Exception as e:  # the template's own checks (roles that must alternate, ...)
                raise RequestError(f"the model's chat template refused the messages: {e}", param="messages") from None
        elif isinstance(req.prompt, str):
            ids = tok.encode(req.prompt)
        else:
            if max(req.prompt) >= self.vocab:
                raise RequestError(f"prompt token id {max(req.prompt)} is outside the vocabulary ({self.vocab})",
                                   param="prompt")
            ids = list(req.prompt)
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(f"the prompt has {len(ids)} tokens; this server takes at most "
                               f"{self.limits.max_prompt_tokens} (--max-prompt-tokens)", param="prompt",
                               code="context_length_exceeded")
        memory = getattr(self.model.runtime, "memory", None)
        if memory is not None and not req.max_tokens_given:  # the default: what the context leaves
            req.max_tokens = max(1, min(req.max_tokens, memory.context - len(ids) - self.ahead))
        over = context_overflow(memory, len(ids), req.max_tokens, ahead=self.ahead)
        if over:
            raise RequestError(f"{over} this server holds a KV cache for (--ctx-size)", param="max_tokens",
                               code="context_length_exceeded")
        bad = [t for t in req.logit_bias or () if not 0 <= t < self.vocab]
        if bad:
            raise RequestError(f"'logit_bias': token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})",
                               param="logit_bias")
        return list(ids)

    def _sampling(self, req):
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        sampler = make_sampler(temp=req.temperature, top_p=req.top_p, min_p=req.min_p, top_k=req.top_k)
        processors = make_logits_processors(logit_bias=req.logit_bias, repetition_penalty=req.repetition_penalty)
        return sampler, processors

    def _between_chunks(self, job):
        """mlx_lm's prompt-progress hook, raising Stopped between prompt chunks. mlx_lm's
        speculative loop has no such hook: with a draft model the prompt runs to its end (the
        line at start says so), and the checks apply from the first token."""
        if self.draft:
            return {}

        def check(done, total):
            why = job.stop_reason()
            if why is not None:
                raise Stopped(why)

        return {"prompt_progress_callback": check}

    def _prefill_step(self):
        """The prompt chunk: PREFILL_CHUNK, or the --memory-limit plan's if smaller."""
        memory = getattr(self.model.runtime, "memory", None)
        step = PREFILL_CHUNK if memory is None else min(PREFILL_CHUNK, memory.prefill_step)
        return {"prefill_step_size": step}

    def _logprobs(self, req, token, logprobs):
        import mlx.core as mx

        decode = self.tokenizer.decode
        top = []
        if req.top_logprobs:
            k = req.top_logprobs
            ids = mx.argpartition(-logprobs, k - 1)[:k]
            vals = logprobs[ids]
            order = mx.argsort(-vals)
            top = [(int(i), decode([int(i)]), float(v)) for i, v in zip(ids[order].tolist(), vals[order].tolist())]
        return (token, decode([token]), float(logprobs[token].item()), top)

    def serve(self, job):
        import mlx.core as mx

        from ..generate import stream_generate

        req, t0 = job.request, time.perf_counter()
        if self.limits.request_timeout:
            job.deadline = time.monotonic() + self.limits.request_timeout
        self.check_sampling(req)
        ids = self.prompt_tokens(req)
        if req.owner != self.kept_owner:  # another client's cache: never reused, never reported
            self.kept.reset()
        self.kept_owner = req.owner
        cache, cached = self.kept.prepare(ids)
        sampler, processors = self._sampling(req)
        if req.seed is not None:
            mx.random.seed(req.seed % (1 << 64))

        gen = stream_generate(self.model, self.tokenizer, ids[cached:], max_tokens=req.max_tokens,
                              prompt_cache=cache, sampler=sampler, logits_processors=processors,
                              **self._prefill_step(), **self._between_chunks(job), **self.draft)
        stops, out, finish = StopText(req.stop), [], "length"
        eos = set(self.tokenizer.eos_token_ids)
        cont = ContinuationText(self.tokenizer) if req.kind == TEXT else None
        def end(tail):
            """The last text: the held-back part unless it completes a stop string."""
            text, stopped = stops.add(tail)
            text += "" if stopped else stops.rest()
            if text:
                job.events.put(Piece(text))
            return "stop" if stopped else None

        try:
            resp = next(gen, None)  # the prompt is processed here; a FlashError (context) raises here
            job.started = True
            job.events.put(Start(len(ids), cached))
            while resp is not None:
                why = job.stop_reason()
                if why == "cancelled":
                    finish = "cancelled"
                    self.cancelled += 1
                    break
                if why == "timeout":  # the answer so far, cut as max_tokens would cut it
                    self.log(f"a request ran past --request-timeout {self.limits.request_timeout:g} s: "
                             "its answer ends here")
                    break
                out.append(resp.token)  # (fed to the model: what the kept cache holds)
                if resp.finish_reason == "stop" and resp.token in eos:  # its text: the detokenizer's last bytes
                    end(resp.text if cont is None else cont.rest())
                    finish = "stop"
                    break
                text, stopped = stops.add(resp.text if cont is None else cont.add(resp.token))
                lp = [self._logprobs(req, resp.token, resp.logprobs)] if req.logprobs else []
                if text or lp:
                    job.events.put(Piece(text, lp))
                if stopped:
                    finish = "stop"
                    break
                if resp.finish_reason is not None:
                    finish = end("" if cont is None else cont.rest()) or resp.finish_reason
                    break
                resp = next(gen, None)
        finally:
            gen.close()
            if req.seed is not None:  # the next request's samples are not predictable from this one's seed
                _reseed()
        completion = len(out) - (1 if out and out[-1] in eos and finish == "stop" else 0)
        self.kept.keep(cache, ids + out)
        job.events.put(Done(finish, len(ids), completion, time.perf_counter() - t0))
