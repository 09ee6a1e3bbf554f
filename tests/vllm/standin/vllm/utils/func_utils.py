"""vllm.utils.func_utils.supports_kw: whether a callable accepts a keyword (its own or via **kwargs)."""

import inspect
from typing import Any, Callable


def supports_kw(callable_: Callable[..., Any], kw_name: str, *, requires_kw_only: bool = False,
                allow_var_kwargs: bool = True) -> bool:
    params = inspect.signature(callable_).parameters
    if not params:
        return False
    param = params.get(kw_name)
    if param is not None:
        if param.kind in (param.VAR_POSITIONAL, param.POSITIONAL_ONLY):
            return False
        if requires_kw_only:
            return param.kind == param.KEYWORD_ONLY
        return True
    if allow_var_kwargs:
        return any(p.kind == p.VAR_KEYWORD for p in params.values())
    return False
