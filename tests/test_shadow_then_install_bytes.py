"""A shadow wave that passes installs the candidate the device already downloaded for its shadow, without downloading
it again (issue 43.3 x the shadow phase): a real Mosquitto, a real fleet and a real agent, the agent's HTTP to the
fleet counted by a loopback proxy (tests/cutting_proxy.py). The agent shadows 1.1.0 (1.5 MB of self-test padding
make the bundle big), live requests are mirrored until the shadow gate passes, the fleet sends the install, and the
bytes carried over the whole rollout are at most the bundle once plus the metadata.

Before: the install desired state ended the shadow by discarding the candidate's files (agent/install/job.py
drop_shadow) before its download, so the bundle came twice (2.0x)."""

from __future__ import annotations

import pytest

from tests.cutting_proxy import CuttingProxy

DEVICE = "edge-shadow-bytes"
PAD_BYTES = 1_500_000
META_BYTES = 64 * 1024  # TUF metadata, the signed time, HTTP heads, tar headers, the manifest (a few KiB each)


@pytest.mark.timeout(300)
def test_the_install_after_a_shadow_reuses_the_shadows_download(tmp_path, digits_bundle, test_images):
    from edgefleet.demo import infer_images
    from edgefleet.fleet.rollout import RolloutSpec
    from edgefleet.fleet.rollout.spec import ShadowGate
    from tests.agent_harness import installed_agent, served_version
    from tests.conftest import running_mosquitto
    from tests.fleet_harness import running_fleet
    from tests.test_tuf_bundles import rebundle
    from tests.waiting import wait_for

    images, _labels = test_images
    new = rebundle(digits_bundle, tmp_path / "v110.tar", pad_bytes=PAD_BYTES, version="1.1.0")
    proxy = CuttingProxy(0)
    link = f"http://127.0.0.1:{proxy.start()}"
    try:
        with running_mosquitto(tmp_path) as broker, \
                running_fleet(tmp_path, broker.url, rollout_tick_s=0.05, public_url=link) as (fs, url):
            proxy.upstream_port = int(url.rsplit(":", 1)[1])
            fs.service.devices.register_device(DEVICE)
            fs.service.models.upload_bundle(new)
            with installed_agent(tmp_path / "agent", digits_bundle, device_id=DEVICE, fleet_url=link,
                                 trusted_root=tmp_path / "keys" / "root.json", max_batch_size=8, instances=1,
                                 intra_op_threads=1, shadow_sample_rate=1.0) as (_agent, agent_url):
                wait_for(lambda: fs.service.devices.get_device(DEVICE).online, 30, "agent online")
                with proxy.lock:
                    proxy.down_bytes = 0
                spec = RolloutSpec(shadow=ShadowGate(agreement_min=0.5, min_samples=20))
                rid = fs.service.rollouts.create_rollout("digits", "1.1.0", [DEVICE], spec=spec).id
                wait_for(lambda: fs.service.devices.get_device(DEVICE).last_state == "shadowing", 60,
                         "the agent shadowing 1.1.0")
                with proxy.lock:
                    shadow_bytes = proxy.down_bytes
                for _ in range(20):  # live requests, mirrored to the candidate, until the gate has its samples
                    infer_images(agent_url, "digits", images[:40])
                    try:
                        wait_for(lambda: fs.service.rollouts.get_rollout(rid).status != "in_progress", 3,
                                 "the wave")
                        break
                    except AssertionError:
                        continue
                assert fs.service.rollouts.get_rollout(rid).status == "succeeded"
                wait_for(lambda: served_version(agent_url) == "1.1.0", 60, "1.1.0 serving after its shadow")
                with proxy.lock:
                    carried = proxy.down_bytes
    finally:
        proxy.stop()
    size = new.stat().st_size
    print(f"\nshadow then install of a {size:,} B bundle: {shadow_bytes:,} B carried for the shadow, "
          f"{carried - shadow_bytes:,} B for the install ({carried / size:.3f}x the bundle in all)")
    assert shadow_bytes >= size - 100_000  # the shadow downloaded it (the digits model itself is held: copied)
    assert carried - shadow_bytes <= META_BYTES, (shadow_bytes, carried)
