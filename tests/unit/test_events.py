"""NRI events and masks, and the NRI version inferred from what the runtime says in Configure."""

from __future__ import annotations

import pytest

from nri_plugin.events import Event, RuntimeInfo, describe_mask, event_mask, infer_nri_version


@pytest.mark.parametrize("name, version, has_timeouts, nri", [
    ("containerd", "v1.7.24", False, (0, 6, 1)),
    ("containerd", "1.7.24", True, (0, 8, 0)),        # timeouts in Configure: at least 0.8
    ("containerd", "v1.7.13", False, (0, 6, 0)),       # NRI 0.4 there, but never below the floor
    ("containerd", "v1.7.26", False, (0, 8, 0)),
    ("containerd", "v2.1.9", True, (0, 8, 0)),
    ("containerd", "v2.2.0", True, (0, 10, 0)),
    ("containerd", "v2.2.1", True, (0, 11, 0)),
    ("containerd", "v2.3.0-rc.1", True, (0, 12, 0)),
    ("containerd", "v1.6.30", False, (0, 6, 0)),      # before 1.7: the floor
    ("containerd", "main-abc123", True, (0, 8, 0)),   # no version: the floor
    ("cri-o", "1.31.0", False, (0, 6, 0)),            # another runtime: the floor
    ("cri-o", "1.31.0", True, (0, 8, 0)),
], ids=["1.7.24", "1.7.24-timeouts", "1.7.13", "1.7.26", "2.1.9", "2.2.0", "2.2.1", "2.3-rc", "1.6",
        "unparsable", "crio", "crio-timeouts"])
def test_nri_version_from_the_runtime_version(name, version, has_timeouts, nri):
    assert infer_nri_version(name, version, has_timeouts) == nri


@pytest.mark.parametrize("version, mask, args", [
    ("v1.7.24", 0x7FF, False), ("v2.1.9", 0x7FF, False), ("v2.2.0", 0x3FFF, True),
], ids=["nri-0.6", "nri-0.8", "nri-0.10"])
def test_runtime_info_caps_the_mask_and_says_whether_args_work(version, mask, args):
    info = RuntimeInfo.from_configure("containerd", version, has_timeouts=version != "v1.7.24")
    assert info.valid_events == mask
    assert info.supports_args_adjustment is args
    assert "containerd" in str(info) and "NRI 0." in str(info)


def test_masks_are_one_bit_per_event_and_never_zero_for_a_subscription():
    events = {Event.CREATE_CONTAINER, Event.POST_CREATE_CONTAINER, Event.REMOVE_CONTAINER}
    mask = event_mask(events)
    assert mask == (1 << 3) | (1 << 4) | (1 << 10)
    assert describe_mask(mask) == "CREATE_CONTAINER|POST_CREATE_CONTAINER|REMOVE_CONTAINER"
    assert describe_mask(0) == "none" and Event.UNKNOWN.bit == 0
    # The validator event (NRI >= 0.10) is outside what 1.7 – 2.1 accept.
    assert event_mask({Event.VALIDATE_CONTAINER_ADJUSTMENT}) & RuntimeInfo.from_configure(
        "containerd", "v2.1.9", True).valid_events == 0
