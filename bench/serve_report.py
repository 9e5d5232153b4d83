"""bench/serve.py's report: the results document printed as tables and lines."""

from __future__ import annotations

import sys
from typing import Any


def print_layouts_and_memory(res: dict[str, Any]) -> None:
    """The layout-vs-limit line, the agent's layout table beside the limit's, and the agent's RSS beside a bare
    process's with the chosen layout's sessions."""
    limit_bests: dict[str, tuple[float, int]] = res.get("limit_by_layout_best") or {}
    if limit_bests:
        best_name = max(limit_bests, key=lambda k: limit_bests[k][0])
        best = limit_bests[best_name][0]
        mine = limit_bests.get(res["agent_layout"])
        print(f"layout vs limit: the agent serves {res['agent_layout']}; the limit's best layout is {best_name} "
              f"({best:.1f} img/s at batch {limit_bests[best_name][1]})"
              + (f"; the limit measured {res['agent_layout']} at {mine[0]:.1f} img/s = {mine[0] / best:.1%} of its best"
                 if mine else "; the limit did not measure the agent's layout"))
        trial = res.get("agent_layouts_img_s") or {}
        print(f"{'layout':>8} {'limit img/s':>12} {'(batch)':>7} {'agent trial img/s':>18} {'trial / limit':>13}")
        for name, (v, b) in limit_bests.items():
            t = trial.get(name)
            print(f"{name:>8} {v:>12.1f} {b:>7} {t if t is not None else '':>18} "
                  f"{f'{t / v:.1%}' if t is not None and v else '':>13}")
    mem = res.get("memory")
    if mem:
        bare, peak = mem["bare_rss_mb"], mem["bare_peak_mb"]
        print(f"memory: the agent's RSS after install {mem['agent_after_install_mb']:.0f} MB "
              f"({mem['agent_after_install_mb'] / bare:.2f}x), after the load {mem['agent_after_load_mb']:.0f} MB "
              f"({mem['agent_after_load_mb'] / bare:.2f}x), peak {mem['agent_peak_mb']:.0f} MB "
              f"({mem['agent_peak_mb'] / peak:.2f}x); a bare process with {mem['bare_layout']}'s sessions run at batch "
              f"{mem['bare_batch']}: RSS {bare:.0f} MB, peak {peak:.0f} MB (goal: each ratio <= 1.3x)")


def print_engines(res: dict[str, Any]) -> None:
    """Each runtime's bare limit in this run, the fastest, and the runtime the agent chose (and why)."""
    by = res.get("limits_by_runtime") or {}
    if not by:
        return
    before, after = res["limits_before_by_runtime"], res["limits_after_by_runtime"]
    cells = [f"{r} {v:.1f} img/s (before {before[r]['images_per_s']:.1f}, {before[r]['layout']} at batch "
             f"{before[r]['best_batch']}; after {after[r]['images_per_s']:.1f}, {after[r]['layout']} at batch "
             f"{after[r]['best_batch']})" for r, v in by.items()]
    rc = res.get("agent_runtime") or {}
    why = ", ".join(f"{k} {v:g}/s" for k, v in (rc.get("items_per_second") or {}).items())
    print(f"engines (bare, this run): {'; '.join(cells)}; the fastest: {res['best_engine']}. The agent serves on "
          f"{rc.get('runtime', 'onnxruntime (it does not say)')}" + (f" ({rc.get('source')}" if rc else "")
          + (f": timed {why})" if why else ")" if rc else ""))
    binary = [r for r in res["rows"] if r["variant"] == "binary"]
    if binary:
        print(f"the agent's share of the fastest engine's limit ({res['best_engine']} "
              f"{by[res['best_engine']]:.1f} img/s), binary OIP: "
              + ", ".join(f"{r['clients']} clients {r['req_per_s']:.1f} req/s = {r['vs_best_engine']:.3f}"
                          for r in binary))
    for r in binary:
        if "spot_limits" in r:
            spots = ", ".join(f"{k} {v:.1f}" for k, v in r["spot_limits"].items())
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["spot_per_cpu_s"].items())
            print(f"  {r['clients']} clients, against the bare limits timed just before and after the level ({spots} "
                  f"img/s): {r['req_per_s']:.1f} / {r['spot_limits'][r['spot_best']]:.1f} = {r['vs_best_spot']:.3f}"
                  + (f"; the agent's runtime ran {r['runtime_img_s']:.1f} img/s while busy "
                     f"({r['runtime_busy']:.1%} of the time)" if "runtime_img_s" in r else "")
                  + (f"; per CPU-second: the agent's inference threads {r['agent_per_cpu_s']:.1f} img, bare {cpu} "
                     f"-> {r['vs_best_per_cpu_s']:.3f}" if "agent_per_cpu_s" in r else ""))


def print_report(doc: dict[str, Any]) -> None:
    pin = doc["config"].get("pin_cpus")
    pinned = f" (pinned: inference on {pin[0]}, the rest on {pin[1]})" if pin else ""
    print(f"\nbench/serve.py: {doc['machine']['cpus']} CPUs{pinned}, python {doc['machine']['python']}, onnxruntime "
          f"{doc['machine']['onnxruntime']}, {doc['config']['threads']} intra-op threads, spinning off everywhere")
    for res in doc["models"]:
        lb, la = res["limit_before"], res["limit_after"]
        b1 = ", ".join(f"{k} {v:.3f} ms" for k, v in res["raw_batch1_ms"].items())
        print(f"\n{res['model']} ({res['precision']}): limit {res['limit_img_s']:.1f} img/s (before "
              f"{lb['images_per_s']:.1f}, {lb['layout']} at batch {lb['best_batch']}; after {la['images_per_s']:.1f}, "
              f"{la['layout']} at batch {la['best_batch']}; sessions x threads); the agent ran "
              f"{res['agent_layout']}, serving {res.get('agent_choice', '?')}; raw batch-1 call {b1}; agent cold "
              f"start to ready "
              f"{res['cold_start_s']:.2f} s, idle RSS {res['idle_rss_mb']:.0f} MB; JSON decode of one request "
              f"{res['json_decode_ms']:.2f} ms (json), {res['json_decode_orjson_ms']:.2f} ms (orjson, the agent's)")
        print_engines(res)
        print_layouts_and_memory(res)
        print(f"{'variant':>12} {'clients':>7} {'req/s':>9} {'vs limit':>8} {'vs best':>8} {'p50 ms':>8} "
              f"{'p99 ms':>8} {'added ms':>8} {'errors':>6} {'wrong':>5} | cores: {'load':>5} {'main':>5} "
              f"{'other':>5} | {'vs limit on CPU left':>20}")
        own = []
        for r in res["rows"]:
            added = f"{r['added_ms']:.3f}" if "added_ms" in r else ""
            if "added_own_ms" in r:
                own.append(f"{r['variant']} {r['added_own_ms']:.3f} ms (p50 {r['p50_ms']:.2f} ms, its batch-1 calls "
                           f"{r['compute_b1_ms']:.2f} ms)")
            print(f"{r['variant']:>12} {r['clients']:>7} {r['req_per_s']:>9.1f} {r['vs_limit']:>8.1%} "
                  f"{r.get('vs_best_engine', r['vs_limit']):>8.1%} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                  f"{added:>8} {r['errors']:>6} {r['wrong']:>5} | "
                  f"{'':>6} {r['load_cores']:>5.2f} {r.get('server_main_cores', float('nan')):>5.2f} "
                  f"{r.get('server_other_cores', float('nan')):>5.2f} | {r['vs_limit_cpu_left']:>20.1%}")
        print("vs limit: against the limit of the first runtime timed (--limit-runtimes); vs best: against the "
              "fastest runtime's limit. "
              "cores: CPU used during the timed phase, in cores, by the load generator, the server's main (event "
              "loop) thread and its other threads (inference; the naive server runs inference on its main thread "
              "and in onnxruntime's pool). vs limit on CPU left: against the limit scaled to the cores the load "
              "generator left.")
        formed = [f"{r['variant']} {r['clients']} clients: runtime busy {r['runtime_busy']:.1%}, batches "
                  f"{r['batches_formed']}" for r in res["rows"] if "batches_formed" in r and r["clients"] > 1]
        if formed:
            print("the agent's runtime in the timed phase (its statistics: the share of the time it ran a batch, "
                  "batches formed by size): " + "; ".join(formed))
        binary = {r["clients"]: r["req_per_s"] for r in res["rows"] if r["variant"] == "binary"}
        for c, v in binary.items():
            near = [f"{r['variant']} {r['req_per_s'] / v:.2f}x" for r in res["rows"] if r["clients"] == c
                    and r["variant"] in ("grpc", "shm", "local", "local-inline")]
            if near:
                print(f"on-box clients at {c} clients, against binary HTTP ({v:,.0f} req/s): " + ", ".join(near))
        if own:
            print("added at 1 client over the agent's own runtime calls in the same run (its statistics): "
                  + "; ".join(own))
        for r in res["rows"]:
            ph = r.get("agent_ms") or {}
            if r["clients"] == 1 and {"success", "queue", "compute_infer"} <= set(ph):
                rest = ph["success"] - ph["queue"] - ph["compute_infer"]
                print(f"where a lone {r['variant']} request's time goes (means, the agent's statistics): in the agent "
                      f"{ph['success']:.3f} ms = queued until its batch started {ph['queue']:.3f} + runtime "
                      f"{ph['compute_infer']:.3f} + the rest (decode, thread hand-offs, encode) {rest:.3f}; outside "
                      f"it (client, loopback, HTTP before the handler) p50 - that = {r['p50_ms'] - ph['success']:.3f}")
        print(f"transport floor: a binary request's bytes to a loopback server that only reads them and back, "
              f"{res['transport_floor_ms']:.3f} ms; through uvicorn and a Starlette route that reads the body (the "
              f"agent's HTTP stack, nothing decoded) {res['asgi_floor_ms']:.3f} ms: that stack adds "
              f"{res['asgi_floor_ms'] - res['transport_floor_ms']:.3f} ms before the agent's own work")
        tgt = ", ".join(f"{c} clients {v:.1f}" for c, v in res["json_target_req_s"].items())
        print(f"JSON target (naive raw-bytes req/s with the decode cost added per request): {tgt}")
        tgt = ", ".join(f"{c} clients {v:.1f}" for c, v in res["json_target_orjson_req_s"].items())
        print(f"JSON target with orjson's decode cost (stricter): {tgt}")
    sys.stdout.flush()
