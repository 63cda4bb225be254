"""An lm-evaluation-harness (``lm_eval`` 0.4) model for a trained workdir: ``--model nested_jax``.

    python -m nested_jax.eval.harness --model nested_jax --model_args workdir=runs/tiny_gdn \\
        --tasks lambada_openai --batch_size 16 [--include_path DIR] [--output_path OUT]

:func:`main` registers :class:`NestedJaxLM` under the name ``nested_jax`` and hands the
arguments to lm_eval's own command line (``lm_eval 0.4.13`` finds models only in its registry; it
has no plugin entry point), so every ``lm-eval run`` flag works unchanged. Model arguments:
``workdir`` (required), ``max_length``, ``chunk``, ``max_gen_toks``, ``gen_block``
(:class:`~nested_jax.eval.harness_options.HarnessOptions`). The batch size is lm_eval's own
``--batch_size`` (default 1: give it; on the command line a ``batch_size`` in ``--model_args``
collides with it inside lm_eval). In Python::

    import lm_eval
    import nested_jax.eval.harness  # registers "nested_jax"
    lm_eval.simple_evaluate(model="nested_jax", model_args={"workdir": "runs/tiny_gdn"},
                            tasks=[...], batch_size=16)

(set ``DISABLE_MULTIPROC=1`` there for tasks with bootstrapped errors, as :func:`main` does:
lm_eval would fork the process that runs JAX.)

The workdir is only read (:func:`nested_jax.train.inference.load_trained`: newest checkpoint,
saved config and tokenizer, the parameters on all local devices). Text goes through the run's own
tokenizer; every encoded context starts with its document separator ``bos_id`` (as the training
documents do), and an empty context is that one token (lm_eval's ``prefix_token_id``).

**What each request computes.** With ``x = (x_1 … x_n)`` the context ids (``x_1 = bos``),
``y = (y_1 … y_m)`` the continuation ids and ``p_θ`` the model's next-token distribution:

- ``loglikelihood(context, continuation)`` →
  ``(Σ_{j=1}^{m} log p_θ(y_j | x, y_{<j}),  ∧_j [y_j = argmax_v p_θ(v | x, y_{<j})])``: the
  summed log-probability of the continuation and whether greedy decoding reproduces it.
- ``loglikelihood_rolling(text)`` → ``Σ_{i=1}^{N} log p_θ(t_i | c_i)`` over all ``N`` ids of the
  text (``t_0 = bos`` conditions the first), where the context ``c_i`` is the whole prefix
  ``t_{<i}`` for a model that streams, and the windows below for a bounded one.
- ``generate_until(context, {until, max_gen_toks})`` → greedy ``y_j = argmax p_θ(· | x, y_{<j})``
  until the separator/EOS id, ``max_gen_toks`` ids (default ``max_gen_toks``), or the first
  ``until`` string; the text before that string is returned. Sampling (``do_sample=True`` or
  ``temperature > 0``) is refused.

**Long contexts.** A model whose mixer is softmax attention without a window (``transformer``,
``hope_attention`` with ``model.window = 0``) is *bounded*: it attends to at most ``max_length``
tokens (model argument; default the run's ``data.seq_len``, the longest context it was trained
on), and inputs are **truncated from the left** like lm_eval's Hugging Face models do:

- loglikelihood: the last ``max_length`` input tokens of ``x ‖ y`` are read (the continuation
  itself must fit: ``m ≤ max_length``, else ``ValueError``);
- loglikelihood_rolling: lm_eval's disjoint rolling windows of ``max_length`` tokens
  (``lm_eval.utils.get_rolling_token_windows`` with context 1): every id is scored once, with
  ``max_length − 1`` ids of context except inside the first window;
- generate_until: the prompt keeps its last ``max_length − max_gen_toks`` ids (``ValueError``
  when ``max_gen_toks ≥ max_length``).

Every other model (``gdn``, ``deltanet``, ``hola``, ``titans_*``, ``hope``, windowed attention)
*streams*: an input of any length is read ``chunk`` tokens per call through the LM's decode state
(:class:`~nested_jax.models.lm.LMCache`, as :func:`nested_jax.eval.continual.stream_tokens`), so
every prediction conditions on the whole input and equals the one-pass forward up to float
rounding (no truncation, no windows; ``max_length`` is not used). The cache of an attention
part (windowed or Titans MAG/MAL attention) holds every position read, so memory grows with the
input. CMS levels are used with their trained weights (no online update).

**Batching.** Requests are sorted by length and run ``batch_size`` at a time (rounded up to a
multiple of the mesh's batch shards; the batch is split over them). Inputs are right-padded to a
bucketed length (powers of two ≥ 16 up to ``chunk``, then ``chunk`` × a power of two), so only a
few programs compile; causal reading makes the padding invisible to the real tokens. Generation
reads the shortest prompt of a batch in chunks, then advances every row one exact decode step at a
time: a row is fed its own prompt id while it has one and its previous greedy id after, so rows of
different lengths share the steps; decoding stops when every row has stopped (checked every
``gen_block`` steps). One process (all its local devices); lm_eval's ``--device`` is ignored.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import lm_eval.models  # noqa: F401  (before registering ours: see register_model below)
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from nested_jax.eval.harness_options import (
    MODEL_NAME,
    HarnessArgumentError,
    _gen_options,
    parse_model_args,
)

__all__ = ["NestedJaxLM", "main"]

_MIN_BUCKET = 16


def _bucket(n: int) -> int:
    """The smallest power of two ``≥ max(n, 16)``."""
    return max(_MIN_BUCKET, 1 << max(0, int(n) - 1).bit_length())


def _layout(longest: int, chunk: int) -> tuple[int, int]:
    """``(n, c)``: inputs of up to ``longest`` tokens are padded to ``n`` pieces of ``c`` tokens
    (one piece of a power of two up to ``chunk``; past it ``chunk`` × a power of two)."""
    if longest <= chunk:
        return 1, min(chunk, _bucket(longest))
    return 1 << (math.ceil(longest / chunk) - 1).bit_length(), chunk


def _prefill_pieces(length: int, chunk: int) -> list[int]:
    """Piece sizes that read the first ``length`` tokens: whole chunks, then powers of two down to
    16 (fewer than 16 tokens are left for the decode steps)."""
    pieces = [chunk] * (length // chunk)
    rest = length - chunk * len(pieces)
    size = 1 << (max(rest, 1).bit_length() - 1)
    while rest >= _MIN_BUCKET and size >= _MIN_BUCKET:
        if size <= rest:
            pieces.append(size)
            rest -= size
        size //= 2
    return pieces


def _token_scores(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(log p(target) f32 [B, T], target == argmax bool [B, T])`` from logits ``[B, T, V]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return lp, jnp.argmax(logits, axis=-1).astype(targets.dtype) == targets


def _cut(text: str, until: Sequence[str]) -> tuple[str, bool]:
    """``text`` before the first of the ``until`` strings, and whether one occurred."""
    hits = [i for i in (text.find(u) for u in until) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class NestedJaxLM(TemplateLM):
    """lm_eval model over a trained nested-jax workdir (see the module docstring for what each
    request computes and how long inputs are read).

    Args (lm_eval model arguments, strings accepted): ``workdir`` and the optional fields of
    :class:`HarnessOptions`; ``max_batch_size`` and ``device`` (given by lm_eval) are ignored.

    Raises:
      HarnessArgumentError (ValueError): a missing ``workdir``, an unknown key or a bad value.
      ConfigError / FileNotFoundError: no run or no readable checkpoint in ``workdir``.
    """

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        self.options = parse_model_args(model_args)
        from nested_jax.layers.attention import Attention
        from nested_jax.models.registry import get_mixer
        from nested_jax.parallel.mesh import batch_shards
        from nested_jax.train.inference import load_trained

        self.trained = load_trained(self.options.workdir)
        self.tokenizer = self.trained.tokenizer
        cfg = self.trained.config
        self.bounded = get_mixer(cfg.model.name) is Attention and cfg.model.window == 0
        self._max_length = self.options.max_length or cfg.data.seq_len
        shards = batch_shards(self.trained.setup.mesh)
        self.rows = -(-self.options.batch_size // shards) * shards
        self._build_functions()

    # -- lm_eval's model protocol ------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        tok = self.tokenizer
        eot = tok.eos_id if tok.eos_id is not None else tok.bos_id
        if eot is None:
            raise ValueError("tokenizer: the run's tokenizer has neither an EOS nor a BOS id")
        return int(eot)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int | None:
        """Context limit of a bounded model (``None``: the model streams, no limit)."""
        return self._max_length if self.bounded else None

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "fingerprint", type(self.tokenizer).__name__))

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """Token ids of ``string``, after the separator ``bos_id`` unless ``add_special_tokens``
        is False (lm_eval asks for that when it prepends ``prefix_token_id`` itself)."""
        ids = list(self.tokenizer.encode(string))
        bos = self.tokenizer.bos_id
        if add_special_tokens is not False and bos is not None:
            ids = [int(bos)] + ids
        return ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """``[(logprob, is_greedy)]`` for ``[((context, continuation), context_ids,
        continuation_ids)]`` (what :meth:`loglikelihood` builds)."""
        rows = []
        for _, ctx, cont in requests:
            full = list(ctx) + list(cont)
            if self.bounded and len(full) - 1 > self._max_length:
                if len(cont) > self._max_length:
                    raise ValueError(
                        f"continuation: {len(cont)} tokens exceed max_length={self._max_length} "
                        "of this attention model"
                    )
                full = full[-(self._max_length + 1) :]  # left truncation
            if cont and len(full) < len(cont) + 1:
                raise ValueError("context: a continuation needs at least one context token")
            rows.append((full, len(cont)))
        out = self._score(rows, disable_tqdm=disable_tqdm, desc="loglikelihood")
        for (strings, _, _), answer in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", strings, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Summed log-likelihood of every id of each text (module docstring: one streamed pass,
        or the disjoint windows of a bounded model)."""
        rows, owner = [], []
        for k, req in enumerate(requests):
            (text,) = req.args
            ids = self.tok_encode(text, add_special_tokens=False)
            if not self.bounded:
                windows = [([self.prefix_token_id], ids)] if ids else []
            else:
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        token_list=ids,
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self._max_length,
                        context_len=1,
                    )
                ]
            for ctx, pred in windows:
                rows.append((list(ctx) + list(pred), len(pred)))
                owner.append(k)
        scores = self._score(rows, disable_tqdm=disable_tqdm, desc="loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for k, (lp, _) in zip(owner, scores, strict=True):
            totals[k] += lp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (module docstring), batched over requests of equal
        ``max_gen_toks``."""
        jobs = []
        for k, req in enumerate(requests):
            context, gen_kwargs = req.args
            until, max_gen = _gen_options(gen_kwargs, self.options.max_gen_toks)
            ids = self.tok_encode(context)
            if self.bounded:
                keep = self._max_length - max_gen
                if keep < 1:
                    raise ValueError(
                        f"max_gen_toks: {max_gen} leaves no room for a prompt within "
                        f"max_length={self._max_length}"
                    )
                ids = ids[-keep:]
            if not ids:
                ids = [self.prefix_token_id]
            jobs.append((k, ids, until, max_gen))
        out = [""] * len(requests)
        by_len = {}
        for job in jobs:
            by_len.setdefault(job[3], []).append(job)
        bar = tqdm(total=len(jobs), desc="generate_until", disable=disable_tqdm)
        for max_gen, group in by_len.items():
            group.sort(key=lambda j: -len(j[1]))
            for i in range(0, len(group), self.rows):
                batch = group[i : i + self.rows]
                texts = self._generate([j[1] for j in batch], max_gen, [j[2] for j in batch])
                for (k, _, _, _), text in zip(batch, texts, strict=True):
                    out[k] = text
                    self.cache_hook.add_partial("generate_until", requests[k].args, text)
                bar.update(len(batch))
        bar.close()
        return out

    # -- the jitted programs -----------------------------------------------------------------------

    def _build_functions(self) -> None:
        from nested_jax.parallel.mesh import replicated
        from nested_jax.train.step import params_to_state

        setup = self.trained.setup
        graphdef, state_def = setup.graphdef, setup.state_def
        out = replicated(setup.mesh)
        donate = () if jax.default_backend() == "cpu" else ("cache",)

        def merged(params, rest):
            return nnx.merge(graphdef, params_to_state(params, state_def), rest)

        @functools.partial(jax.jit, out_shardings=out)
        def score_once(params, rest, tokens, targets):  # [B, c]: one full forward, no cache
            return _token_scores(merged(params, rest)(tokens)[0], targets)

        @functools.partial(jax.jit, out_shardings=out)
        def score_stream(params, rest, tokens, targets):  # [B, n, c]: n pieces through the cache
            model = merged(params, rest)
            b, n, c = tokens.shape

            def body(cache, xs):
                logits, cache = model(xs[0], cache=cache)
                return cache, _token_scores(logits, xs[1])

            xs = (jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(targets, 0, 1))
            _, (lp, greedy) = jax.lax.scan(body, model.init_cache(b, n * c), xs)
            return tuple(jnp.swapaxes(a, 0, 1).reshape(b, n * c) for a in (lp, greedy))

        @functools.partial(jax.jit, static_argnames=("rows", "capacity"))
        def init_cache(params, rest, *, rows, capacity):
            return merged(params, rest).init_cache(rows, capacity)

        @functools.partial(jax.jit, donate_argnames=donate)
        def prefill(params, rest, cache, tokens):  # [B, c] more tokens into the cache
            logits, cache = merged(params, rest)(tokens, cache=cache)
            return cache, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

        @functools.partial(jax.jit, static_argnames=("steps",), donate_argnames=donate)
        def decode(params, rest, cache, prev, prompt, lengths, *, steps):
            """``steps`` exact one-token steps from position ``cache.pos``: row ``r`` reads its
            prompt id while the position is below ``lengths[r]``, else its previous greedy id."""
            model = merged(params, rest)
            last = prompt.shape[1] - 1

            def body(carry, _):
                cache, prev = carry
                t = cache.pos
                forced = jax.lax.dynamic_index_in_dim(
                    prompt, jnp.minimum(t, last), axis=1, keepdims=False
                )
                tok = jnp.where(t < lengths, forced, prev)
                logits, cache = model(tok[:, None], cache=cache)
                nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
                return (cache, nxt), nxt

            (cache, prev), preds = jax.lax.scan(body, (cache, prev), None, length=steps)
            return cache, prev, preds.T

        self._score_once, self._score_stream = score_once, score_stream
        self._init_cache, self._prefill, self._decode = init_cache, prefill, decode

    def _on_mesh(self, array: np.ndarray) -> jax.Array:
        from nested_jax.train.inference import host_batch_to_mesh

        return host_batch_to_mesh(np.asarray(array, np.int32), self.trained.setup.mesh)[0]

    def _score(self, rows, *, disable_tqdm: bool, desc: str) -> list[tuple[float, bool]]:
        """``[(Σ log p, all greedy)]`` over the last ``m`` targets of each ``(ids, m)`` row
        (inputs ``ids[:-1]``, targets ``ids[1:]``), in batches of similar length."""
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        todo = []
        for i, (_, m) in enumerate(rows):
            if m == 0:
                results[i] = (0.0, True)
            else:
                todo.append(i)
        todo.sort(key=lambda i: -len(rows[i][0]))
        setup = self.trained.setup
        bar = tqdm(total=len(todo), desc=desc, disable=disable_tqdm)
        for start in range(0, len(todo), self.rows):
            batch = todo[start : start + self.rows]
            n, c = _layout(max(len(rows[i][0]) - 1 for i in batch), self.options.chunk)
            tokens = np.zeros((self.rows, n * c), np.int32)
            targets = np.zeros((self.rows, n * c), np.int32)
            for r, i in enumerate(batch):
                ids = rows[i][0]
                tokens[r, : len(ids) - 1] = ids[:-1]
                targets[r, : len(ids) - 1] = ids[1:]
            with jax.set_mesh(setup.mesh):
                if n == 1:
                    lp, greedy = self._score_once(
                        self.trained.params, setup.rest, self._on_mesh(tokens),
                        self._on_mesh(targets),
                    )  # fmt: skip
                else:
                    shape = (self.rows, n, c)
                    lp, greedy = self._score_stream(
                        self.trained.params, setup.rest, self._on_mesh(tokens.reshape(shape)),
                        self._on_mesh(targets.reshape(shape)),
                    )  # fmt: skip
            lp, greedy = np.asarray(lp, np.float64), np.asarray(greedy)
            for r, i in enumerate(batch):
                ids, m = rows[i]
                end = len(ids) - 1
                results[i] = (
                    float(lp[r, end - m : end].sum()),
                    bool(greedy[r, end - m : end].all()),
                )
            bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]

    def _generate(
        self, prompts: list[list[int]], max_gen: int, until: list[list[str]]
    ) -> list[str]:
        """Greedy continuations of ``len(prompts) ≤ rows`` prompts (module docstring)."""
        if max_gen == 0:
            return [""] * len(prompts)
        setup, params = self.trained.setup, self.trained.params
        block = self.options.gen_block
        lengths = [len(p) for p in prompts] + [len(prompts[0])] * (self.rows - len(prompts))
        padded = list(prompts) + [prompts[0]] * (self.rows - len(prompts))
        prompt = np.zeros((self.rows, _bucket(max(lengths))), np.int32)
        for r, ids in enumerate(padded):
            prompt[r, : len(ids)] = ids
        capacity = _bucket(max(lengths) + max_gen + block)
        preds = np.full((self.rows, capacity), -1, np.int64)  # greedy id after each position
        eos = self.tokenizer.eos_id
        done = [False] * len(prompts)
        texts = [""] * len(prompts)
        with jax.set_mesh(setup.mesh):
            cache = self._init_cache(params, setup.rest, rows=self.rows, capacity=capacity)
            prev = self._on_mesh(np.zeros((self.rows,), np.int32))
            pos = 0
            for size in _prefill_pieces(min(lengths), self.options.chunk):
                piece = self._on_mesh(prompt[:, pos : pos + size])
                cache, prev = self._prefill(params, setup.rest, cache, piece)
                pos += size
            if pos:
                preds[:, pos - 1] = np.asarray(prev)
            prompt_dev = self._on_mesh(prompt)
            lengths_dev = self._on_mesh(np.asarray(lengths, np.int32))
            while not all(done):
                cache, prev, ids = self._decode(
                    params, setup.rest, cache, prev, prompt_dev, lengths_dev, steps=block
                )
                preds[:, pos : pos + block] = np.asarray(ids)
                pos += block
                for r in range(len(prompts)):
                    if done[r]:
                        continue
                    first = lengths[r] - 1
                    gen = list(preds[r, first : min(pos, first + max_gen)])
                    stop = eos is not None and eos in gen
                    if stop:
                        gen = gen[: gen.index(eos)]
                    texts[r], hit = _cut(self.tokenizer.decode(gen), until[r])
                    done[r] = stop or hit or pos - first >= max_gen
        return texts


# lm_eval fills its registry with its own models' names lazily, only when a lookup finds the
# registry empty: this module imports lm_eval.models first, or registering ours would leave
# `--model hf` (and every other lm_eval model) unresolvable in this process. Under
# `python -m nested_jax.eval.harness` this file also runs as __main__: only the imported module
# registers (a second class under the same name would be refused by lm_eval's registry).
if __name__ != "__main__":
    register_model(MODEL_NAME)(NestedJaxLM)


@contextlib.contextmanager
def _without_forks():
    """lm_eval forks worker processes in two places of a run: bootstrap standard errors
    (``multiprocessing.Pool``, unless ``DISABLE_MULTIPROC`` is set) and the printed results table
    (pytablewriter's ``DataPropertyExtractor`` converts cells in a ``ProcessPoolExecutor`` of
    ``cpu_count()`` workers). Forking a process that runs JAX's threads can deadlock (JAX warns),
    so both run in-process while this is active."""
    from unittest import mock

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {"DISABLE_MULTIPROC": "1"}))
        try:
            from pytablewriter.writer import _table_writer

            base = _table_writer.DataPropertyExtractor
        except (ImportError, AttributeError):  # another pytablewriter layout: left as it is
            base = None
        if base is not None:

            class InProcess(base):
                def __init__(self, *args, **kwargs):
                    super().__init__(*args, **kwargs)
                    self.max_workers = 1

            stack.enter_context(
                mock.patch.object(_table_writer, "DataPropertyExtractor", InProcess)
            )
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """``lm-eval`` with the ``nested_jax`` model registered: ``argv`` (default ``sys.argv[1:]``)
    is lm_eval's own command line (``run`` is implied, as with ``lm-eval``). lm_eval's worker
    processes (bootstrap errors, the results table) run in-process: forking JAX can deadlock.

    Returns the exit status: 0, argparse's status when it exits (``--help``: 0, a bad flag: 2),
    or 2 with a one-line ``error: ...`` on stderr for a bad ``nested_jax`` model argument.
    """
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else list(argv))]
    try:
        with _without_forks():
            cli_evaluate()  # lm_eval 0.4.13 parses sys.argv itself
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except HarnessArgumentError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    from nested_jax.eval.harness import main as _registered_main

    sys.exit(_registered_main())
