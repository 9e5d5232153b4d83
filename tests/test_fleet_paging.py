"""Server-side paging and filtering: GET /api/v1/devices and a rollout's targets, against a real fleet."""

from __future__ import annotations

import httpx

from tests.fleet_harness import api, running_fleet
from tests.test_rollout import upload


def test_devices_and_targets_page_and_filter_on_the_server(tmp_path, mosquitto, digits_bundle):
    with running_fleet(tmp_path, mosquitto.url) as (_, url):
        upload(url, digits_bundle)
        for i in range(12):
            r = api.post(f"{url}/api/v1/devices", json={"device_id": f"cam-{i:02d}", "profile": "x86-cpu",
                                                        "group": "lab" if i % 2 else "yard"})
            assert r.status_code == 201, r.text
        everyone = api.get(f"{url}/api/v1/devices")  # no parameters: every device, as before
        assert len(everyone.json()) == 12 and everyone.headers["x-total-count"] == "12"

        r = api.get(f"{url}/api/v1/devices?limit=5&offset=5")
        assert [d["device_id"] for d in r.json()] == [f"cam-{i:02d}" for i in range(5, 10)]
        assert r.headers["x-total-count"] == "12"
        r = api.get(f"{url}/api/v1/devices", params={"group": "lab", "q": "cam-1"})
        assert [d["device_id"] for d in r.json()] == ["cam-11"]
        assert api.get(f"{url}/api/v1/devices?state=offline").headers["x-total-count"] == "12"
        assert api.get(f"{url}/api/v1/devices?state=online").json() == []
        assert api.get(f"{url}/api/v1/devices", params={"q": "%"}).json() == []  # LIKE wildcards are literal
        assert api.get(f"{url}/api/v1/devices", params={"q": "_"}).json() == []
        assert api.get(f"{url}/api/v1/devices?limit=100000").status_code == 422  # above MAX_PAGE
        assert api.get(f"{url}/api/v1/devices?offset=-1").status_code == 422

        rid = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0",
                                                       "group": "yard"}).json()["id"]
        full = api.get(f"{url}/api/v1/rollouts/{rid}").json()
        assert len(full["targets"]) == 6 and "targets_total" not in full
        paged = api.get(f"{url}/api/v1/rollouts/{rid}?targets_limit=4&targets_offset=4").json()
        assert [t["device_id"] for t in paged["targets"]] == ["cam-08", "cam-10"] and paged["targets_total"] == 6
        state = full["targets"][0]["state"]
        same = api.get(f"{url}/api/v1/rollouts/{rid}", params={"targets_state": state, "targets_limit": 1}).json()
        assert same["targets_total"] == sum(t["state"] == state for t in full["targets"]) and len(same["targets"]) == 1
        none = api.get(f"{url}/api/v1/rollouts/{rid}?targets_state=nope").json()
        assert none["targets"] == [] and none["targets_total"] == 0
        assert "targets" not in api.get(f"{url}/api/v1/rollouts/{rid}?targets=false&targets_limit=3").json()

        # the console: one page, the filter form keeps its values (escaped), links keep the filters
        cookies = {"edgefleet_token": api.token or ""}
        html = httpx.get(f"{url}/", params={"q": '"><script>', "group": "lab"}, cookies=cookies).text
        # escaped by the console's templates (markupsafe writes " as &#34;)
        assert "<script>" not in html.split("</style>", 1)[1] and "&#34;&gt;&lt;script&gt;" in html
        html = httpx.get(f"{url}/?offset=5", cookies=cookies).text
        assert "rows <b>6–12</b> of <b>12</b>" in html and 'rel="prev" href="/"' in html and "cam-04" not in html
        html = httpx.get(f"{url}/rollouts/{rid}?state={state}", cookies=cookies).text
        assert f'<option value="{state}" selected>' in html
