"""ImageIds: the pre-check's image ids, one lookup per image name per ttl."""

from __future__ import annotations

from nri_plugin.imageids import ImageIds


def test_an_id_is_looked_up_once_per_ttl_and_an_unknown_one_every_time():
    asked: list[str] = []
    ids = {"app:1": "sha256:aa"}
    now = [100.0]

    def lookup(image: str) -> str:
        asked.append(image)
        return ids.get(image, "")

    cache = ImageIds(lookup, ttl=10.0, clock=lambda: now[0])
    assert [cache("app:1") for _ in range(50)] == ["sha256:aa"] * 50
    assert cache("gone:1") == "" and cache("gone:1") == ""
    assert asked == ["app:1", "gone:1", "gone:1"]
    ids["app:1"] = "sha256:bb"  # the tag moved: seen once the ttl is over
    now[0] += 9.9
    assert cache("app:1") == "sha256:aa"
    now[0] += 0.2
    assert cache("app:1") == "sha256:bb"
    assert asked.count("app:1") == 2
