"""The catalogue itself (pure): one entry per setting, registries that name their policies and build them,
bounds that refuse what they say, and old names that point at the new ones."""

from __future__ import annotations

import math

import pytest

from impl.policy import FixedTTL, GapQuantileTTL, GiveBack, HeartbeatLease, catalogue
from impl.policy.catalogue import (CONNECTOR, REGISTRIES, REMOVED, RENAMED, RETENTION, ROUTER, SETTINGS, SIM,
                                   UNDER_PRESSURE, SettingError)


def test_one_entry_per_setting_each_on_some_surface():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    for s in SETTINGS:
        assert s.surfaces and s.surfaces <= set(catalogue.SURFACES), s.name
        assert s.help and s.kind in (bool, int, float, str), s.name
        if s.default is not None or not s.optional:
            assert s.check(s.default, next(iter(s.surfaces))) == s.default, s.name  # its default is in bounds


def test_every_policy_reads_catalogue_settings_and_every_selector_names_its_registry():
    for family, registry in REGISTRIES.items():
        assert catalogue.setting(registry.selector).family == family
        assert catalogue.default(registry.selector) in registry.names()
        for policy in registry:
            for name, _ in policy.args:
                catalogue.setting(name)  # raises if the catalogue lacks it
    selectors = {s.name for s in SETTINGS if s.family is not None}
    assert selectors == {r.selector for r in REGISTRIES.values()}


def test_building_a_policy_takes_defaults_from_the_policy_class():
    assert RETENTION.build("ttl", {}) == FixedTTL()
    assert RETENTION.build("lease", {"lease_s": 60.0}) == HeartbeatLease(lease_s=60.0)
    assert UNDER_PRESSURE.build("give_back", {}) == GiveBack()
    assert UNDER_PRESSURE.build("pinned", {}) is None


def test_gap_initial_defaults_to_the_ttl_or_the_cap_when_the_ttl_is_infinite():
    assert RETENTION.build("gap_quantile", {"decoder_kv_blocks_ttl": 300.0}).initial_s == 300.0
    built = RETENTION.build("gap_quantile", {"decoder_kv_blocks_ttl": math.inf, "gap_cap_s": 700.0})
    assert isinstance(built, GapQuantileTTL) and built.initial_s == 700.0
    assert RETENTION.build("gap_quantile", {"gap_initial_s": 42.0}).initial_s == 42.0


def test_a_policys_rejection_names_the_settings_as_the_surface_spells_them():
    with pytest.raises(SettingError) as info:
        RETENTION.build("lease", {"lease_s": 30.0, "heartbeat_interval_s": 45.0}, spell=lambda n: "bidikv_" + n)
    assert info.value.names == ("heartbeat_interval_s", "lease_s")
    assert str(info.value).startswith("bidikv_heartbeat_interval_s must be > 0 and shorter than bidikv_lease_s")
    with pytest.raises(SettingError) as info:  # the argument is "max_hold_s"; the setting is lease_max_hold_s
        RETENTION.build("lease", {"lease_max_hold_s": -1.0})
    assert info.value.names == ("lease_max_hold_s",) and str(info.value).startswith("lease_max_hold_s ")
    with pytest.raises(SettingError) as info:  # FixedTTL's argument is "seconds": the word in the text stays
        RETENTION.build("ttl", {"decoder_kv_blocks_ttl": -1.0})
    assert str(info.value).startswith("decoder_kv_blocks_ttl must be a non-negative duration in s")


@pytest.mark.parametrize("name, value, surface", [
    ("kv_recompute_threshold", -1, SIM), ("kv_recompute_threshold", 1.5, SIM), ("kv_recompute_threshold", True, SIM),
    ("decoder_kv_blocks_ttl", math.inf, CONNECTOR), ("decoder_kv_blocks_ttl", -1.0, SIM),
    ("decoder_kv_blocks_ttl", math.nan, SIM), ("gap_quantile", 0.0, SIM), ("gap_quantile", 1.5, CONNECTOR),
    ("give_back_headroom", 1.0, SIM), ("idle_step_sleep_s", 31.0, CONNECTOR), ("heartbeat_port", 70000, CONNECTOR),
    ("retention", "oracle", CONNECTOR), ("placement", "random", ROUTER), ("notify", "yes", ROUTER),
    ("learnt_retention_fallback_s", math.inf, ROUTER),
])
def test_bounds_refuse_what_they_say(name, value, surface):
    with pytest.raises(ValueError, match="must be"):
        catalogue.setting(name).check(value, surface)


def test_bounds_accept_the_edges_they_include():
    assert catalogue.setting("decoder_kv_blocks_ttl").check(math.inf, SIM) == math.inf
    assert catalogue.setting("gap_quantile").check(1, SIM) == 1.0
    assert catalogue.setting("give_back_headroom").check(0, CONNECTOR) == 0.0
    assert catalogue.setting("retention").check("oracle", SIM) == "oracle"


def test_old_names_point_at_new_ones_on_the_surfaces_that_carry_them():
    for old, new in RENAMED.items():
        assert old not in {s.name for s in SETTINGS} and new in {s.name for s in SETTINGS}
        for surface in catalogue.setting(new).surfaces:
            assert catalogue.old_name_message(old, surface) == f"{old} is now {new}"
    for (surface, name), why in REMOVED.items():
        kept_on = catalogue.setting(name).surfaces if name in {s.name for s in SETTINGS} else frozenset()
        assert surface not in kept_on  # removed from this surface, perhaps kept on others
        assert catalogue.old_name_message(name, surface) == f"{name} was removed: {why}"
    assert catalogue.old_name_message("lease_s", SIM) is None


def test_a_registry_refuses_a_second_policy_of_the_same_name():
    with pytest.raises(ValueError, match="already registered"):
        RETENTION.register(catalogue.Policy("ttl", "again"))
    with pytest.raises(ValueError, match="retention must be one of"):
        RETENTION["forever"]


def test_every_deployable_retention_names_the_setting_that_bounds_its_holds():
    # the deploy recipe starts the router with it as --decoder-kv-blocks-ttl (impl/deploy/render.py)
    for policy in RETENTION:
        if CONNECTOR in policy.surfaces:
            assert CONNECTOR in catalogue.setting(policy.longest_hold).surfaces, policy.name
