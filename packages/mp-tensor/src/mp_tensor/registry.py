"""Which module class is distributed by which DistributedModule, and how (docs/tensor.md).

Two kinds of entries:

- built-in ones (``nn.Linear``, ``nn.Embedding``, the Hugging Face GPT-2/BERT/RoBERTa blocks) carry a
  *builder* that reads the sizes off an existing module, builds the distributed module and copies the
  weights into its shards;
- user ones, from :func:`tp_register` / :func:`tp_register_with_module`, carry smp's hooks. The
  registered class's ``__init__`` is wrapped to record its arguments, which ``init_hook`` translates into
  the distributed module's; ``forward_hook``/``return_hook`` translate each call. The weights are
  copied when the original module's state dict (after ``translate_functions[0]``, if given) has the keys
  and shapes of the distributed module's full state dict, i.e. the reference implementation's.

Hugging Face classes are matched by their qualified name, so registering them imports nothing.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor, nn

from mp_tensor.errors import TPModuleRegisterError
from mp_tensor.nn.base import DistributedModule

__all__ = [
    "INIT_ARGS_ATTR",
    "REGISTRATION_ATTR",
    "Builder",
    "Registration",
    "Registry",
    "default_registry",
    "tp_register",
    "tp_register_with_module",
]

log = logging.getLogger(__name__)

INIT_ARGS_ATTR = "_mp_tp_init_args"
REGISTRATION_ATTR = "_mp_tp_registration"
"""Set by a builder on the module it built: the registration (translations) to keep for that module."""

#: (original module, its TP context, override kwargs) -> the distributed module, weights copied.
Builder = Callable[[nn.Module, Any, Mapping[str, Any]], DistributedModule]
StateDictFn = Callable[[Mapping[str, Tensor]], dict[str, Tensor]]

M = TypeVar("M", bound=type[nn.Module])


@dataclass(frozen=True)
class Registration:
    """One entry: the original class (or its qualified name) and how to distribute it."""

    module_cls: type[nn.Module] | str
    dist_cls: type[DistributedModule]
    init_hook: Callable[..., Any] | None = None
    forward_hook: Callable[..., Any] | None = None
    return_hook: Callable[..., Any] | None = None
    builder: Builder | None = None
    check: Callable[[nn.Module, int], str | None] | None = None
    """Returns why ``module`` cannot be distributed over this many ranks, or None."""
    to_original: StateDictFn | None = None
    """Full (reference-layout) state dict of the distributed module -> the original module's layout."""
    from_original: StateDictFn | None = None
    """The original module's state dict -> the reference layout."""
    bind: Callable[[nn.Module], Registration] | None = None
    """For translations that depend on the module's sizes (GPT-NeoX's head count): this entry with
    them bound to one original module's."""

    def for_module(self, module: nn.Module) -> Registration:
        """This entry with its translations bound to ``module`` (an instance of the original class)."""
        return self if self.bind is None else self.bind(module)

    @property
    def name(self) -> str:
        return self.module_cls if isinstance(self.module_cls, str) else qualified_name(self.module_cls)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Registry:
    """Module classes and their distributed implementations; the latest registration of a class wins."""

    def __init__(self) -> None:
        self._by_class: dict[type[nn.Module], Registration] = {}
        self._by_name: dict[str, Registration] = {}

    def add(self, registration: Registration) -> None:
        if isinstance(registration.module_cls, str):
            self._by_name[registration.module_cls] = registration
        else:
            self._by_class[registration.module_cls] = registration

    def remove(self, module_cls: type[nn.Module] | str) -> None:
        if isinstance(module_cls, str):
            self._by_name.pop(module_cls, None)
        else:
            self._by_class.pop(module_cls, None)

    def lookup(self, module: nn.Module) -> Registration | None:
        """The entry for ``module``'s exact class, if any."""
        cls = type(module)
        found = self._by_class.get(cls)
        return found if found is not None else self._by_name.get(qualified_name(cls))

    def entries(self) -> list[Registration]:
        return [*self._by_class.values(), *self._by_name.values()]


default_registry = Registry()


def _check_hook(name: str, hook: object) -> None:
    if hook is not None and not callable(hook):
        raise TPModuleRegisterError(f"tp_register got {name}={hook!r}; expected a callable or None.")


def _check_dist(dist_module: object) -> None:
    if not (isinstance(dist_module, type) and issubclass(dist_module, DistributedModule)):
        raise TPModuleRegisterError(
            f"tp_register got dist_module={dist_module!r}; expected a subclass of smp.nn.DistributedModule "
            "(for example smp.nn.DistributedTransformer)."
        )


_RECORDS_ARGS_ATTR = "_mp_records_args"
"""Set on an ``__init__`` that ``_record_init_args`` wrapped already."""


def _record_init_args(module_cls: type[nn.Module]) -> None:
    """Wrap ``module_cls.__init__`` (once) so each instance remembers its constructor arguments."""
    own = module_cls.__dict__.get("__init__")
    if own is not None and getattr(own, _RECORDS_ARGS_ATTR, False):
        return
    original = module_cls.__init__

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self) is module_cls and INIT_ARGS_ATTR not in self.__dict__:
            self.__dict__[INIT_ARGS_ATTR] = (args, kwargs)

    setattr(__init__, _RECORDS_ARGS_ATTR, True)
    module_cls.__init__ = __init__  # type: ignore[method-assign]


def tp_register_with_module(  # noqa: PLR0917
    module_cls: type[nn.Module],
    dist_module: type[DistributedModule],
    init_hook: Callable[..., Any] | None = None,
    forward_hook: Callable[..., Any] | None = None,
    return_hook: Callable[..., Any] | None = None,
    translate_functions: Iterable[StateDictFn] | None = None,
    *,
    registry: Registry | None = None,
) -> None:
    """Register ``dist_module`` as the distributed implementation of ``module_cls`` (smp's API).

    ``translate_functions``: optional ``(from_original, to_original)`` state-dict translations between
    ``module_cls``'s layout and ``dist_module``'s reference layout, used to copy the weights into the
    shards and to gather the state dict back.
    """
    _check_dist(dist_module)
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TPModuleRegisterError(
            f"tp_register_with_module got module_cls={module_cls!r}; expected an nn.Module class."
        )
    for name, hook in (
        ("init_hook", init_hook),
        ("forward_hook", forward_hook),
        ("return_hook", return_hook),
    ):
        _check_hook(name, hook)
    from_original = to_original = None
    if translate_functions is not None:
        fns = list(translate_functions)
        if len(fns) != 2 or not all(callable(f) for f in fns):
            raise TPModuleRegisterError(
                f"tp_register got translate_functions={translate_functions!r}; expected a pair of callables "
                "(from the original state dict to the reference layout, and back)."
            )
        from_original, to_original = fns
    if init_hook is not None:
        try:
            inspect.signature(init_hook)
        except (TypeError, ValueError) as exc:  # pragma: no cover - builtins without signatures
            raise TPModuleRegisterError(
                f"tp_register: init_hook {init_hook!r} has no inspectable signature"
            ) from exc
    _record_init_args(module_cls)
    (registry or default_registry).add(
        Registration(
            module_cls,
            dist_module,
            init_hook,
            forward_hook,
            return_hook,
            to_original=to_original,
            from_original=from_original,
        )
    )
    log.debug(
        "registered %s as the distributed version of %s", dist_module.__name__, qualified_name(module_cls)
    )


def tp_register(
    dist_module: type[DistributedModule],
    init_hook: Callable[..., Any] | None = None,
    forward_hook: Callable[..., Any] | None = None,
    return_hook: Callable[..., Any] | None = None,
) -> Callable[[M], M]:
    """Class decorator: the decorated module class is distributed by ``dist_module`` (smp's API)."""
    _check_dist(dist_module)
    for name, hook in (
        ("init_hook", init_hook),
        ("forward_hook", forward_hook),
        ("return_hook", return_hook),
    ):
        _check_hook(name, hook)

    def decorate(module_cls: M) -> M:
        tp_register_with_module(module_cls, dist_module, init_hook, forward_hook, return_hook)
        return module_cls

    return decorate
