"""Pick a variant from a registry once, at start-up, with its options bound.

The hot path then calls a plain function and never branches on a name. Unknown names and options
that the chosen function does not take fail here, at start-up, not at the first training step.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable, Mapping


def select(registry: Mapping[str, Callable[..., Any]], what: str, name: str, **options: Any) -> Callable[..., Any]:
    """`registry[name]` with `options` bound as keywords.

    `what` names the registry in errors ("advantage estimator"). Raises ValueError for an unknown
    name (listing the valid ones) and TypeError for an option the function does not accept.
    """
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(sorted(registry))}")
    fn = registry[name]
    params = inspect.signature(fn).parameters
    bad = [k for k in options if k not in params or params[k].kind is not inspect.Parameter.KEYWORD_ONLY]
    if bad:
        valid = [k for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        raise TypeError(f"{what} {name!r} takes no option {', '.join(bad)}; its options: {', '.join(valid) or 'none'}")
    return partial(fn, **options) if options else fn
