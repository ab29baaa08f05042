"""The options of `hf-kvcache compare`: those every suite takes (`SuiteOptions`), each suite's own dataclass that
extends them (the `OPTIONS` of its module), and the command line generated from those dataclasses.

A field becomes the flag `--name-with-dashes`; its `option(...)` metadata gives the help, the element type, `nargs`
and the choices. A suite module declares its options and nothing else: `add_suite_arguments` adds one argument
group per suite module, and `options_of` builds the options of the suite asked for, refusing a flag the suite does
not take (instead of ignoring it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

# passkey / needle / ruler: how the cache meets the question (see `suites.passkey`)
MODES = ("agnostic", "question")
MODE_HELP = ("agnostic: the context compressed before the question is seen; question: context + question prefilled "
             "together, then (h2o) evicted to the budget of the context + the question, then decoded")


def option(default: Any, help: str, *, type: type | None = None, nargs: str | None = None,
           choices: tuple | list | None = None) -> Any:
    """A dataclass field that is also a command-line flag.

    Args:
        default: the field's default (a list is copied per instance).
        help: the flag's help text.
        type: the type argparse converts each value to (None: the type of `default`, else str).
        nargs: argparse's `nargs` ("+" for a list).
        choices: the values the flag accepts.

    Returns:
        A `dataclasses.field`."""
    meta = {"help": help, "type": type, "nargs": nargs, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (query-agnostic or question-aware), got {mode!r}")


@dataclass
class SuiteOptions:
    """The options every suite takes (None: the suite's own default). `suite` and the flags below are the
    `compare` command's own; a suite's dataclass adds its flags."""

    suite: str = "perplexity"
    model: str = "smollm2-135m"
    text: str = "moby-dick"
    start: int = 5000
    tokens: list[int] | None = None  # tokens scored / cached; several for kernels, append, needle and ruler
    chunk: int | None = None  # tokens per forward (passkey: 0 prefills the context in one forward)
    caches: list[str] | None = None  # cache specs (name, name:{json}, label=name:{json}); added to a preset
    threads: int | None = None
    progress: bool = True
    json: str | None = None  # the rows file (ruler writes its sample rows there as they come)

    def one_length(self, default: int) -> int:
        """The single `tokens` value of a suite that takes one (its default when none is given)."""
        if not self.tokens:
            return default
        if len(self.tokens) != 1:
            raise ValueError(f"--suite {self.suite} takes one --tokens value, got {self.tokens}; only kernels, append, "
                             "needle and ruler take several")
        if self.tokens[0] < 2:
            raise ValueError(f"--tokens must be at least 2, got {self.tokens[0]}")
        return self.tokens[0]


# options several suites take, each defined once
def budgets_option() -> Any:
    return option(None, "passkey / needle / ruler: each cache with a budget option at each budget (int: tokens, "
                  "float <= 1: ratio; ruler default 0.5 0.25 with the default caches); cpac: the memory_budget rows",
                  type=float, nargs="+")


def mode_option() -> Any:
    return option("agnostic", MODE_HELP, choices=MODES)


def seed_option() -> Any:
    return option(0, "seed of the generated samples / trials / sampling")


def decode_steps_option() -> Any:
    return option(None, "single-token steps timed (perplexity 16, 0: none; decode 64; append 64); shared-prefix: "
                  "tokens sampled per sequence (32)", type=int)


def device_option() -> Any:
    return option(None, "cuda or cpu (default: cuda when visible)", type=str)


MODEL_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype_option() -> Any:
    return option("float32", "the dtype the model is loaded in (its caches store keys / values in it; the "
                  "perplexity is taken from float32 logits either way)", choices=list(MODEL_DTYPES))


def loop_option() -> Any:
    from ..bench import LOOPS

    return option("attached", "attached: inside hf_kvcache.attached, as generate runs (default); plain: model(ids, "
                  "past_key_values=cache) with the model's own attention, as a user's loop does (sdpa calls that a "
                  "layer asks queries / mass of are served); unserved: that loop with nothing reported to the cache "
                  "(an eager model's loop)", choices=list(LOOPS))


def depths_option() -> Any:
    return option([0.0, 0.25, 0.5, 0.75, 1.0], "depths of the key in the context (0: start, 1: end)", type=float,
                  nargs="+")


def trials_option() -> Any:
    return option(20, "trials per depth")


def new_tokens_option() -> Any:
    return option(None, "tokens decoded per answer (passkey / needle 8, greedy 24; prefill-memory: generated after "
                  "the prompt, 8)", type=int)


# suite name -> module of this package that holds its `run` and its `OPTIONS`; peers and ablations are cache
# presets of perplexity
SUITES: dict[str, str] = {
    "perplexity": "perplexity",
    "peers": "perplexity",
    "ablations": "perplexity",
    "cpac": "cpac",
    "decode": "decode",
    "kernels": "kernels",
    "append": "append",
    "passkey": "passkey",
    "shared-prefix": "shared_prefix",
    "needle": "needle",
    "ruler": "ruler",
    "long": "long",
    "greedy": "greedy",
    "calibration": "calibration",
    "prefill-memory": "prefill_memory",
    "reconstruct-cost": "reconstruct_cost",
    "adapt": "adapt",
    "long-perplexity": "long",  # the suite name long-context rows carry (`eval/long_context.py`)
}


def suite_module(suite: str):
    """The module of this package that runs `suite`.

    Raises:
        ValueError: for a name that is no suite."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; pick one of: {', '.join(SUITES)}")
    return importlib.import_module(f"{__package__}.{SUITES[suite]}")


def options_class(suite: str) -> type[SuiteOptions]:
    """The options dataclass of `suite` (its module's `OPTIONS`)."""
    return suite_module(suite).OPTIONS


def own_fields(cls: type[SuiteOptions]) -> list[dataclasses.Field]:
    """The fields `cls` adds to `SuiteOptions`: the flags of one suite."""
    common = {f.name for f in dataclasses.fields(SuiteOptions)}
    return [f for f in dataclasses.fields(cls) if f.name not in common]


def _suites_by_class() -> dict[type[SuiteOptions], list[str]]:
    out: dict[type[SuiteOptions], list[str]] = {}
    for suite in SUITES:
        out.setdefault(options_class(suite), []).append(suite)
    return out


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_suite_arguments(p: argparse.ArgumentParser) -> None:
    """One argument group per suite options class, generated from its own fields. A flag is added once (with the
    help of the first suite that takes it); its default is left out of the namespace, so that `options_of` sees
    which flags were given."""
    added: set[str] = set()
    by_class = _suites_by_class()
    takers: dict[str, list[str]] = {}
    for cls, suites in by_class.items():
        for f in own_fields(cls):
            takers.setdefault(f.name, []).extend(suites)
    for cls, suites in by_class.items():
        fields = own_fields(cls)
        if not fields:
            continue
        shared = [flag(f.name) for f in fields if f.name in added]
        g = p.add_argument_group(" / ".join(suites) + (f" (also {' '.join(shared)})" if shared else ""))
        for f in fields:
            if f.name in added:
                continue
            added.add(f.name)
            meta = f.metadata
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            kwargs: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=meta.get("help", ""))
            if isinstance(default, bool):
                kwargs["action"] = "store_false" if default else "store_true"
            else:
                kwargs["type"] = meta.get("type") or (type(default) if default is not None else str)
                if meta.get("nargs"):
                    kwargs["nargs"] = meta["nargs"]
                if meta.get("choices") is not None:
                    kwargs["choices"] = list(meta["choices"])
                if default is not None:
                    shown = " ".join(map(str, default)) if isinstance(default, list) else default
                    kwargs["help"] += f" (default {shown})"
            others = [s for s in takers[f.name] if s not in suites]
            if others:
                kwargs["help"] += f"; also {', '.join(others)}"
            g.add_argument(flag(f.name), **kwargs)


def suite_options(suite: str, **values: Any) -> SuiteOptions:
    """The options of `suite` with `values` set (the rest at their defaults).

    Raises:
        ValueError: for an option `suite` does not take (naming the suites that take it)."""
    cls = options_class(suite)
    names = {f.name for f in dataclasses.fields(cls)}
    foreign = sorted(k for k in values if k not in names)
    if foreign:
        takers = {k: [s for s in SUITES if k in {f.name for f in dataclasses.fields(options_class(s))}]
                  for k in foreign}
        said = "; ".join(f"{flag(k)} ({'options of ' + ', '.join(v) if v else 'no suite takes it'})"
                         for k, v in takers.items())
        raise ValueError(f"--suite {suite} takes no {said}: leave them out")
    return cls(suite=suite, **values)


def options_of(args: argparse.Namespace, suite: str | None = None) -> SuiteOptions:
    """The options of parsed `compare` arguments (or of a command with some of them: `bench`, `passkey`) for `suite`
    (default `args.suite`): the common flags, and every suite flag that was given.

    Raises:
        ValueError: when a given flag belongs to other suites."""
    suite = suite or args.suite
    known = {f.name for cls in _suites_by_class() for f in dataclasses.fields(cls)}
    return suite_options(suite, **{k: v for k, v in vars(args).items() if k in known and k != "suite"})
