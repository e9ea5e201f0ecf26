"""How a policy hooks into a PagedKVCache: one interface for all of them.

StreamingLLM (``streaming.py``), whole-sequence eviction (``eviction.py``) and
prefix caching (``prefix.py``) each subclass :class:`CachePolicy` and override
the hooks they need; the others do nothing.  The facade (``cache.py``) holds
its policies in a :class:`PolicySet` and calls each hook once per operation,
in the policies' order, under the cache's lock and after the core has done the
operation.  No policy knows of another, and neither the facade nor
``persist.py`` asks which policies are present.

The hooks:

=====================================  ========================================================
``attach(core)``                       once, when the cache is built (StreamingLLM sets the
                                       core's trim sizes; eviction binds to the core)
``wrap_append(fn)``,                   compose the cache's ``append`` / ``append_batch`` (each
``wrap_append_batch(fn)``              policy wraps what the previous one returned; called
                                       again when ``auto_evict`` changes).  Returning `fn`
                                       keeps the core's own method: the hot path gains nothing
``start(priority, token_ids, salt)``   start a sequence (prefix caching adopts cached blocks);
                                       None leaves it to the next policy, then to the core
``forked(parent, child)``              ``fork``
``truncated(sid, length)``             ``truncate``
``released(sid)``                      a sequence freed or evicted
``trimming(sid)``                      before a one-shot StreamingLLM trim; raise to refuse
``compacting()``, ``compacted(map)``   around ``compact`` (map: old block id -> new)
``resized()``                          after ``resize``
``saved(sid)``, ``loaded(sid, state)`` persistence: what a policy keeps of a sequence in its
                                       file (a dict of JSON-able values and hashable salts;
                                       ``persist.py`` owns the encoding), and a loaded one
``stats()``                            the CacheStats fields the policy fills in
=====================================  ========================================================
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional


class CachePolicy:
    """A policy of a PagedKVCache; every hook here does nothing (see the module docstring)."""

    def attach(self, core) -> None:
        pass

    def wrap_append(self, fn):
        return fn

    def wrap_append_batch(self, fn):
        return fn

    def start(self, priority: float, token_ids, salt) -> Optional[int]:
        return None

    def forked(self, parent: int, child: int) -> None:
        pass

    def truncated(self, sid: int, length: int) -> None:
        pass

    def released(self, sid: int) -> None:
        pass

    def trimming(self, sid: int) -> None:
        pass

    def compacting(self) -> None:
        pass

    def compacted(self, moved_to) -> None:
        pass

    def resized(self) -> None:
        pass

    def saved(self, sid: int) -> Dict[str, Any]:
        return {}

    def loaded(self, sid: int, state: Dict[str, Any]) -> None:
        pass

    def stats(self) -> Dict[str, Any]:
        return {}


def _each(name: str):
    """A PolicySet hook calling hook `name` of every policy in order."""
    def hook(self, *args):
        for p in self.policies:
            getattr(p, name)(*args)
    hook.__name__ = name
    return hook


class PolicySet(CachePolicy):
    """The policies of one cache, called in order; itself a CachePolicy."""

    def __init__(self, policies: Iterable[CachePolicy]):
        self.policies = tuple(policies)

    attach = _each("attach")
    forked = _each("forked")
    truncated = _each("truncated")
    released = _each("released")
    trimming = _each("trimming")
    compacting = _each("compacting")
    compacted = _each("compacted")
    resized = _each("resized")
    loaded = _each("loaded")

    def wrap_append(self, fn):
        for p in self.policies:
            fn = p.wrap_append(fn)
        return fn

    def wrap_append_batch(self, fn):
        for p in self.policies:
            fn = p.wrap_append_batch(fn)
        return fn

    def start(self, priority, token_ids, salt):
        for p in self.policies:
            sid = p.start(priority, token_ids, salt)
            if sid is not None:
                return sid
        return None

    def saved(self, sid):
        state: Dict[str, Any] = {}
        for p in self.policies:
            state.update(p.saved(sid))
        return state

    def stats(self):
        fields: Dict[str, Any] = {}
        for p in self.policies:
            fields.update(p.stats())
        return fields
