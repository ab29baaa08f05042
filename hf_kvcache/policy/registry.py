"""The registry of eviction policies by name: `register_policy`, `POLICIES`, and building a policy from a name and
its options (`policy_from_options`), with errors that name the policies an option belongs to."""

from __future__ import annotations

from typing import Any

from .base import EvictionPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(policy: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make `policy` (an `EvictionPolicy` subclass with a unique `name`) available by name. Returns it, so it can
    decorate the class."""
    if not (isinstance(policy, type) and issubclass(policy, EvictionPolicy)):
        raise ValueError(f"register_policy takes an EvictionPolicy subclass, got {policy!r}")
    if not policy.name or POLICIES.get(policy.name, policy) is not policy:
        raise ValueError(f"policy name {policy.name!r} is empty or taken; set a unique `name` on {policy.__name__}")
    POLICIES[policy.name] = policy
    return policy


def option_users(option: str) -> list[str]:
    """The registered policies that declare `option`."""
    return [name for name, cls in POLICIES.items() if option in cls.option_names()]


def policy_from_options(name: str, options: dict[str, Any]) -> EvictionPolicy:
    """The registered policy `name` built with `options`; an option it does not declare raises a ValueError naming
    the policies that take it."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r} is not valid; choose one of {list(POLICIES)}")
    cls = POLICIES[name]
    for option in options:
        if option not in cls.option_names():
            users = option_users(option)
            noun = "policy" if len(users) == 1 else "policies"
            raise ValueError(f"{option} applies to the {' / '.join(users)} {noun}, not {name!r}")
    return cls(**options)
