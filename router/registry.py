"""Scorer registry: config keys (kebab-case) -> scorer factories.

Why a registry: `RouterConfig.scorer_weights` names scorers by key, so adding a
scorer is one new file plus one `register_scorer` call, with no change to the
policy. Registering a key twice raises, and so does looking up an unknown key:
a typo in a config file fails at startup instead of silently switching a
scorer off. The built-in scorers are registered when this module is imported;
no init call is needed.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Mapping

from router.scorers import Scorer
from router.scorers.load import LoadScorer
from router.scorers.prefix_cache import PrefixCacheScorer
from router.scorers.session_affinity import SessionAffinityScorer
from router.scorers.session_balance import SessionBalanceScorer

ScorerFactory = Callable[[], Scorer]

SCORERS: dict[str, ScorerFactory] = {}

_KEY_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def register_scorer(key: str, factory: ScorerFactory) -> None:
    """Adds a scorer under `key`.

    Raises:
        ValueError: `key` is not kebab-case or is already registered.
    """
    if not _KEY_PATTERN.match(key):
        raise ValueError(f"scorer key {key!r} must be kebab-case (e.g. 'prefix-cache')")
    if key in SCORERS:
        raise ValueError(f"scorer {key!r} is already registered")
    SCORERS[key] = factory


def lookup_scorer(key: str) -> ScorerFactory:
    """The factory registered under `key`.

    Raises:
        ValueError: unknown key; the message lists the known ones.
    """
    try:
        return SCORERS[key]
    except KeyError:
        raise ValueError(f"unknown scorer {key!r}; known scorers: {sorted(SCORERS)}") from None


def build_weighted_scorers(weights: Mapping[str, float]) -> list[tuple[Scorer, float]]:
    """Instantiates every scorer with a positive weight, in the mapping's order.

    Every key is looked up, zero weights included, so a misspelt key always
    raises. Keys absent from `weights` are off.

    Raises:
        ValueError: an unknown key, or a weight that is negative or not finite.
    """
    built: list[tuple[Scorer, float]] = []
    for key, weight in weights.items():
        factory = lookup_scorer(key)
        if not 0 <= weight < math.inf:
            raise ValueError(f"scorer {key!r} has weight {weight}; it must be finite and >= 0")
        if weight > 0:
            built.append((factory(), float(weight)))
    return built


for _factory in (PrefixCacheScorer, LoadScorer, SessionAffinityScorer, SessionBalanceScorer):
    register_scorer(_factory.name, _factory)
del _factory
