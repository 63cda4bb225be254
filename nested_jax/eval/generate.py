"""``nested-jax generate``: sample a continuation of a prompt from a trained workdir.

    nested-jax generate --workdir runs/tiny_gdn --prompt "It is a truth universally" \\
                        [--max-new-tokens 200] [--temperature 0.8] [--top-k 40] [--seed 0]
                        [--state-in DIR] [--state-out DIR] [--capacity N]

``--state-in`` continues a saved stream (``nested-jax eval --stream ... --state-out DIR`` or an
earlier ``generate --state-out``): the prompt is read by the memories (and online CMS levels) the
stream left behind. ``--state-out`` saves the state after the prompt and the sampled tokens
(generated tokens update the memories; CMS levels only learn from a stream with targets, so they
are carried unchanged). ``--capacity`` is the number of positions the stream's KV caches hold in
all (attention mixers); by default a saved stream keeps
:data:`~nested_jax.eval.continual.HEADROOM` free positions and a continued one is enlarged as
needed, so ``generate`` → ``generate`` → ``eval --stream`` chains need no flag.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from nested_jax.train.config import ConfigError, add_override_argument


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nested-jax generate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workdir", required=True, help="a training workdir (config.json + checkpoints/)"
    )
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_override_argument(p, "override a field of the saved config")
    p.add_argument("--state-in", help="continue from a saved stream state directory")
    p.add_argument("--state-out", help="save the stream state to this new directory")
    p.add_argument(
        "--capacity",
        type=int,
        default=0,
        help="positions the stream's KV caches hold in all (default: the positions read, plus "
        "4096 free ones with --state-out; a continued stream is enlarged as needed)",
    )
    return p


def generate_text(
    trained,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    state_in: str | None = None,
    state_out: str | None = None,
    capacity: int = 0,
) -> str:
    """The sampled continuation (text after the prompt) of `prompt` for a :class:`TrainedModel`,
    optionally continuing / saving a stream state (:mod:`nested_jax.eval.continual`) whose caches
    hold `capacity` positions (:func:`~nested_jax.eval.continual.stream_capacity`; 0: default)."""
    import jax

    from nested_jax.eval import continual
    from nested_jax.models import generate

    tok = trained.tokenizer
    ids = list(tok.encode(prompt))
    # Training documents start after the separator/BOS id: start the prompt the same way (a
    # continued stream already has its context).
    bos = getattr(tok, "bos_id", None)
    if bos is not None and state_in is None:
        ids = [bos] + ids
    if not ids:
        raise ValueError("prompt: encodes to no tokens; give some text")
    model, stream, periods = trained.model(), None, None
    save = state_out is not None
    if state_in is not None:
        stream, periods = continual.load_stream_state(state_in, model.init_cache, trained.params)
        needed = int(stream.pos) + len(ids) + max_new_tokens
        size = continual.stream_capacity(
            capacity, needed=needed, saved=int(stream.capacity), save=save
        )
        stream = continual.resize_stream(stream, model.init_cache, size)
        model = continual.model_with_fast(model, stream.fast)
    elif save or capacity:
        size = continual.stream_capacity(capacity, needed=len(ids) + max_new_tokens, save=save)
        stream = continual.init_stream(model.init_cache, trained.params, capacity=size)
    out, cache = generate(
        model,
        np.asarray([ids], np.int32),
        max_new_tokens,
        rng=jax.random.key(seed),
        temperature=temperature,
        top_k=top_k,
        cache=None if stream is None else stream.cache,
        return_cache=True,
    )
    if save:
        stream = stream._replace(pos=cache.pos, cache=cache)
        continual.save_stream_state(state_out, stream, periods=periods)
    return tok.decode(np.asarray(out)[0, len(ids) :].tolist())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 0:
        print("error: --max-new-tokens must be >= 0", file=sys.stderr)
        return 2
    from nested_jax.parallel.distributed import maybe_initialize
    from nested_jax.train.inference import load_trained

    maybe_initialize()

    try:
        trained = load_trained(args.workdir, args.overrides)
        text = generate_text(
            trained,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            state_in=args.state_in,
            state_out=args.state_out,
            capacity=args.capacity,
        )
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    import jax

    if jax.process_index() == 0:  # every process computed the same text: print it once
        print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
