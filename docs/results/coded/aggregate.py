import json, statistics as st
base = None
rows = {}
for s in (0, 1, 2):
    ev = [json.loads(l) for l in open(f"runs/v4/lopd-s{s}/eval.jsonl")]
    base = ev[0]
    rows[s] = {d["step"]: (d["mean_reward"], d["success_rate"], d["generations"]) for d in ev}
steps = sorted(set.intersection(*(set(r) for r in rows.values())))
print("base (step 0, greedy): reward %.4f success %.3f" % (base["mean_reward"], base["success_rate"]))
for step in steps:
    rw = [rows[s][step][0] for s in rows]; sc = [rows[s][step][1] for s in rows]
    print(f"step {step:2d} ({rows[0][step][2]} rollouts): reward {st.mean(rw):.4f} ± {st.pstdev(rw):.4f} "
          f"[{', '.join(f'{x:.4f}' for x in rw)}]  success {st.mean(sc):.4f} ± {st.pstdev(sc):.4f}")
