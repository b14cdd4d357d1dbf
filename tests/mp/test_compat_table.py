"""mp.compat: every smp name has a status, names marked built exist in mp (on real objects where they are
set at run time), every config key is in the table, and the rendered table holds them all."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mp as smp
from mp.compat import (
    CONFIG_GROUP,
    INSTANCE_ATTRIBUTES,
    NOTES,
    REFUSED_ENGINES,
    mp_additions,
    registry,
    render_markdown,
    resolves,
)
from mp.config_model import ModelParallelConfig
from mp.dp_backend import check_engines
from mp.errors import ConfigError

SPEC = Path(__file__).resolve().parents[3] / "shared" / "reference" / "smp_api.md"


def test_every_smp_name_has_a_status_and_what_differs_says_how() -> None:
    rows = registry()
    missing = [r.name for r in rows if r.status is None]
    assert not missing, f"smp names without a status (add them to mp.compat.NOTES): {missing}"
    unexplained = [r.name for r in rows if r.status != "built" and not r.note]
    assert not unexplained, f"names that differ or are not built need a note: {unexplained}"
    names = [(r.group, r.name) for r in rows]
    assert len(names) == len(set(names)), "a name is listed twice in smp_names.txt"


def test_names_marked_built_are_importable_from_mp() -> None:
    alias = importlib.import_module("smdistributed.modelparallel.torch")
    for row in registry():
        if row.group == CONFIG_GROUP or row.status != "built":
            continue
        assert resolves(row.name), row.name
        if row.name in INSTANCE_ATTRIBUTES or "(" in row.name:
            continue  # checked on real objects below / in the signature by resolves()
        obj: Any = smp
        for part in row.name.split("."):
            obj = (
                getattr(obj, part)
                if hasattr(obj, part)
                else importlib.import_module(f"{obj.__name__}.{part}")
            )
        if "." not in row.name:  # smp scripts import it by smp's own path too
            assert getattr(alias, row.name) is obj, row.name


def test_a_name_that_does_not_resolve_is_never_built() -> None:
    assert not resolves("no_such_function")
    assert not resolves("DistributedModel.no_such_method")
    assert not resolves("DistributedModel(no_such_argument)")
    assert not resolves("patches.checkpoint.checkpoint")


def test_every_config_key_and_alias_is_in_the_table() -> None:
    table = {r.name: r.status for r in registry() if r.group == CONFIG_GROUP}
    accepted = [*ModelParallelConfig.all_keys(), *ModelParallelConfig.aliases()]
    field_names = {f.name for f in dataclasses.fields(ModelParallelConfig)}
    missing = [k for k in accepted if k not in table and k not in field_names]  # field names: alt spellings
    assert not missing, f"config keys missing from the compatibility table: {missing}"
    for key, status in table.items():
        if key not in accepted:
            assert status == "not built", f"{key} is refused as unknown but marked {status}"


def test_notes_only_name_smp_names() -> None:
    names = {r.name for r in registry()}
    stale = sorted(set(NOTES) - names)
    assert not stale, f"mp.compat.NOTES names that are not in smp_names.txt or the config: {stale}"


def test_refused_engines_are_exactly_those_smp_init_refuses() -> None:
    refused = []
    for f in dataclasses.fields(ModelParallelConfig):
        if f.default is not False:
            continue
        try:
            cfg = ModelParallelConfig(**{f.name: True})
        except ConfigError:  # needs another key with it (e.g. load_partition): not an engine
            continue
        try:
            check_engines(cfg)
        except ConfigError:
            refused.append(f.name)
    assert sorted(refused) == sorted(REFUSED_ENGINES)
    table = {r.name: r.status for r in registry()}
    assert all(table[k] == "not built" for k in REFUSED_ENGINES)


def test_spec_config_keys_are_all_in_the_names_file() -> None:
    if not SPEC.exists():
        pytest.skip(f"the spec is not beside this checkout ({SPEC})")
    text = SPEC.read_text(encoding="utf-8").split("## 4. Configuration parameters")[1].split("## 5.")[0]
    keys = set(re.findall(r"^\| `(\w+)`", text, re.M))
    keys |= set(re.findall(r"`(_?\w+)`", text.split("Other internal [S] keys:")[1].split("\n\n")[0]))
    table = {r.name for r in registry() if r.group == CONFIG_GROUP}
    assert keys and not keys - table, sorted(keys - table)


def test_rendered_table_lists_every_name_once() -> None:
    text = render_markdown()
    assert "NO STATUS" not in text
    for row in registry():
        shown = f"`{row.name}`" if row.group == CONFIG_GROUP else f"`smp.{row.name}`"
        assert text.count(f"| {shown} |") == 1, row.name
    assert re.match(r"\d+ names: \d+ built, \d+ differ from smp, \d+ not built\.", text)


def _instance_attributes(world: Any, precision: str) -> list[str]:
    smp.init({} if precision == "fp32" else {precision: True})
    model = smp.DistributedModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    owners = {"DistributedModel": model, "DistributedOptimizer": optimizer}
    found = [
        n
        for n in INSTANCE_ATTRIBUTES
        if n.split(".")[0] in owners and hasattr(owners[n.split(".")[0]], n.split(".")[1])
    ]
    if precision != "fp32":  # NOTES: under fp16/bf16 smp's extras sit on the wrapped optimizer
        inner = optimizer.optimizer
        assert all(hasattr(inner, a) for a in ("param_name_to_index", "local_optimizer_state_dict"))
    return found


def test_instance_attributes_exist_on_real_objects(worlds: Any) -> None:
    (fp32,) = worlds.run(1, _instance_attributes, "fp32")
    (bf16,) = worlds.run(1, _instance_attributes, "bf16")
    found = set(fp32) | set(bf16)
    if hasattr(smp.StepOutput([torch.zeros(1)]), "outputs"):
        found.add("StepOutput.outputs")
    assert found == set(INSTANCE_ATTRIBUTES), sorted(set(INSTANCE_ATTRIBUTES) - found)
    assert "DistributedOptimizer.optimizer" in bf16


def test_the_docs_build_renders_the_table_into_the_compatibility_page() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    spec = importlib.util.spec_from_file_location("docs_conf", docs / "conf.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    source = [(docs / "compatibility.md").read_text(encoding="utf-8")]
    conf._insert_compat_table(None, "compatibility", source)
    assert conf.COMPAT_MARKER not in source[0]
    assert render_markdown() in source[0]


def test_every_facade_name_is_an_smp_row_or_an_mp_addition() -> None:
    """The compatibility page's rows follow the facade's one table (mp._SOURCES): a name added there
    appears on the page, as an smp name's row or among the names mp adds."""
    text = render_markdown()
    added = dict(mp_additions())
    for name in smp.__all__:
        if name in added:
            assert f"| `smp.{name}` | `{added[name]}` |" in text, name
        else:
            # an smp name's row, its patches.checkpoint path, or (smp.nn, smp.amp) rows of its members
            rows = (f"| `smp.{name}` |", f"`smp.patches.checkpoint.{name}`", f"| `smp.{name}.")
            assert any(row in text for row in rows), name
    assert "wait_checkpoint" in added and "DistributedModel" not in added
