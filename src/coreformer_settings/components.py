"""What the objective and task registries share, importable without torch: an entry names where its member lives
and the class of the settings it owns; from a registry come the flags, config keys and checked values of those
settings.

    Registered(target, settings)     "package.module:NAME" of the member (imported only by a run), and its settings
                                     class (a RunSettings dataclass of `arg` fields, checked in __post_init__)
    owned_fields(registry)           setting name -> (the first member that owns it, its field), in registry order
    gather_owned(values, registry, into)   raw run values with the members' settings gathered into one mapping
    owned_settings(registry, name, values, kind=...)   member `name`'s settings, typed and checked; a setting of
                                     another member is refused, naming it
    add_owned_flags(parser, registry, kind=...)   a group of flags per member that owns settings
    Members(registry, kind)          name -> the registered object, each loaded on first use (a live view: a member
                                     registered later is in it too)

The member's code reads its settings as one object (`args.objective_settings`, `args.task_settings`); on the
command line and in config files they are flat keys like every other setting.
"""

import argparse
import dataclasses
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .base import RunSettings, add_flags


@dataclass
class NoSettings(RunSettings):
    """The settings of a member that owns none."""


@dataclass(frozen=True)
class Registered:
    """One registry entry: where the member is ("package.module:NAME") and the class of the settings it owns."""

    target: str
    settings: type[RunSettings] = NoSettings


def owned_fields(registry: Mapping[str, Registered]) -> dict[str, tuple[str, dataclasses.Field]]:
    """setting name -> (the first registered member that owns it, its field), in registry order; a setting that
    several members share (one settings class extending another) is listed once."""
    owned: dict[str, tuple[str, dataclasses.Field]] = {}
    for name, entry in registry.items():
        for spec in entry.settings.cli_fields():
            owned.setdefault(spec.name, (name, spec))
    return owned


def gather_owned(
    values: Mapping[str, Any], registry: Mapping[str, Registered], into: str, *, run: type[RunSettings]
) -> dict[str, Any]:
    """`values` with every registered member's settings (flat keys, or an `into` mapping as run_config.json holds
    them) gathered into `values[into]`, which the run's member types and checks. A member's setting may not take
    the name of a setting of the `run` itself (the flag would be two)."""
    values = dict(values)
    gathered = dict(values.pop(into, None) or {})
    owned = owned_fields(registry)
    clash = sorted(set(owned) & {spec.name for spec in dataclasses.fields(run)})
    if clash:
        name = clash[0]
        raise run.error(f"`{name}` of {owned[name][0]} is a setting of every run already; give it another name.")
    gathered.update({name: values.pop(name) for name in list(values) if name in owned})
    return {**values, into: gathered}


def owned_settings(
    registry: Mapping[str, Registered], name: str, values: Mapping[str, Any] | RunSettings, *, kind: str
) -> RunSettings:
    """The settings of the registered member `name` (the `kind` of thing it is: "objective", "task") from raw
    values or settings already built, typed and checked by its settings class. A setting another member owns is
    refused, naming that member."""
    if isinstance(values, RunSettings):
        values = dataclasses.asdict(values)
    settings = registry[name].settings
    own = {spec.name for spec in dataclasses.fields(settings)}
    owners = owned_fields(registry)
    for setting in values:
        if setting in own:
            continue
        if setting in owners:
            owner = owners[setting][0]
            raise settings.error(
                f"`{setting}` is a setting of the {owner} {kind}, and this run's {kind} is {name}; drop it or pass "
                f"--{kind} {owner}."
            )
        known = ", ".join(sorted(own)) or "none"
        raise settings.error(f"Unknown {kind} setting {setting!r}; the {name} {kind} has: {known}.")
    return settings.resolve(dict(values))


def add_owned_flags(
    parser: argparse.ArgumentParser, registry: Mapping[str, Registered], *, kind: str, **flag_options: Any
) -> None:
    """Under a heading per member that owns settings, a flag per setting (`add_flags` with `flag_options`)."""
    members: dict[str, list[dataclasses.Field]] = {}
    for owner, spec in owned_fields(registry).values():
        members.setdefault(owner, []).append(spec)
    for owner, fields in members.items():
        group = parser.add_argument_group(f"settings of the {owner} {kind}")
        add_flags(group, registry[owner].settings, fields, **flag_options)


class Members(Mapping[str, Any]):
    """name -> the object `registry[name].target` names (its module imported on first use), checked to be a `kind`
    called `name`; over the registry as it is now."""

    def __init__(self, registry: Mapping[str, Registered], kind: type) -> None:
        self.registry, self.kind = registry, kind

    def __getitem__(self, name: str) -> Any:
        if name not in self.registry:
            raise KeyError(name)
        module, _, attribute = self.registry[name].target.partition(":")
        found = getattr(importlib.import_module(module), attribute)
        if not isinstance(found, self.kind) or found.name != name:
            raise TypeError(f"The registry entry {name!r} names {found!r}, not a {self.kind.__name__} called {name!r}.")
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry)

    def __len__(self) -> int:
        return len(self.registry)
