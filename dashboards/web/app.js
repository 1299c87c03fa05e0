// expertmesh dashboard: polls /api/v1/dashboard every second and redraws.
// Everything shown is set with textContent / attributes (never innerHTML), so
// names and values from the controller cannot inject markup.
"use strict";

(function () {
  const POLL_MS = 1000;
  const $ = (id) => document.getElementById(id);
  const state = { layer: 0, ranksPlot: null, timelinePlot: null, selected: null, numLayers: 0 };

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    if (attrs) for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }
  function fmt(x, d = 3) { return Number.isFinite(x) ? x.toFixed(d) : "–"; }
  function bytes(n) {
    if (!Number.isFinite(n) || n <= 0) return "0 B";
    const u = ["B", "kB", "MB", "GB", "TB", "PB"];
    const i = Math.min(u.length - 1, Math.floor(Math.log10(n) / 3));
    return (n / 10 ** (3 * i)).toFixed(i ? 1 : 0) + " " + u[i];
  }
  function when(t) { return t ? new Date(t * 1000).toLocaleTimeString() : "–"; }
  function ago(s) { return s < 1 ? "now" : s < 90 ? `${Math.round(s)} s ago` : s < 5400 ? `${Math.round(s / 60)} min ago` : `${Math.round(s / 3600)} h ago`; }
  // integer ticks 0, k, 2k, ... with k in 1, 2, 5, 10, 20, ... so that at most ~max labels show
  function ticks(n, max) {
    let k = 1;
    for (const m of [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]) { k = m; if (Math.ceil(n / m) <= max) break; }
    return Array.from({ length: Math.ceil(n / k) }, (_, i) => i * k);
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  // ---- heatmap (canvas) ----
  const RAMP = [[13, 27, 42], [27, 73, 101], [42, 157, 143], [233, 196, 106], [244, 162, 97], [231, 111, 81]];
  function color(v) {
    const x = Math.max(0, Math.min(1, v)) * (RAMP.length - 1);
    const i = Math.min(RAMP.length - 2, Math.floor(x)), f = x - i;
    const c = RAMP[i].map((a, k) => Math.round(a + (RAMP[i + 1][k] - a) * f));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  function drawHeatmap(rows) {
    const cv = $("heatmap");
    const L = rows.length, E = L ? rows[0].length : 0;
    const width = cv.clientWidth || 1200;
    const height = Math.max(40, Math.min(320, L * 28));
    cv.width = width; cv.height = height; cv.style.height = height + "px";
    const ctx = cv.getContext("2d");
    ctx.clearRect(0, 0, width, height);
    let max = 0;
    for (const r of rows) for (const v of r) max = Math.max(max, v);
    const cw = E ? width / E : 0, ch = L ? height / L : 0;
    for (let l = 0; l < L; l++) {
      for (let e = 0; e < E; e++) {
        ctx.fillStyle = color(max > 0 ? rows[l][e] / max : 0);
        ctx.fillRect(Math.floor(e * cw), Math.floor(l * ch), Math.ceil(cw), Math.ceil(ch) - 1);
      }
    }
    // axis labels as text beside the canvas: a layer per row, expert numbers below
    const layers = $("heatmap-layers");
    layers.style.height = height + "px";
    layers.replaceChildren(...rows.map((_, l) => {
      const s = el("span", null, `layer ${l}`);
      s.style.height = (L ? height / L : 0) + "px";
      return s;
    }));
    $("heatmap-experts").replaceChildren(...ticks(E, 24).map((e) => {
      const s = el("span", { "data-expert": e }, e);
      s.style.left = ((e + 0.5) / E * 100) + "%";
      return s;
    }));
    cv.dataset.layers = L; cv.dataset.experts = E; cv.dataset.max = max.toFixed(2);
    cv.dataset.sum = rows.reduce((s, r) => s + r.reduce((a, b) => a + b, 0), 0).toFixed(2);
    $("heatmap-max").textContent = max.toFixed(1);
    state.heat = { rows, cw, ch };
  }
  $("heatmap").addEventListener("mousemove", (ev) => {
    const h = state.heat, tip = $("heatmap-tip");
    if (!h || !h.rows.length) return;
    const r = ev.target.getBoundingClientRect();
    const e = Math.floor((ev.clientX - r.left) * (ev.target.width / r.width) / h.cw);
    const l = Math.floor((ev.clientY - r.top) * (ev.target.height / r.height) / h.ch);
    if (l < 0 || l >= h.rows.length || e < 0 || e >= h.rows[0].length) { tip.hidden = true; return; }
    tip.textContent = `layer ${l} · expert ${e}: ${h.rows[l][e].toFixed(1)} tokens`;
    tip.style.left = (ev.clientX - r.left + 12) + "px";
    tip.style.top = (ev.clientY - r.top + 12) + "px";
    tip.hidden = false;
  });
  $("heatmap").addEventListener("mouseleave", () => { $("heatmap-tip").hidden = true; });

  // ---- charts (uPlot) ----
  function chartWidth(id) { return Math.max(300, $(id).clientWidth || 500); }
  function drawRanks(d) {
    const n = d.rank_before.length;
    const xs = Array.from({ length: n }, (_, i) => i);
    const data = [xs, d.rank_before, d.rank_after];
    $("ranks-summary").replaceChildren(
      document.createTextNode("max/mean: static "), el("b", null, fmt(d.imbalance_before)),
      document.createTextNode(" → plan "), el("b", { class: d.imbalance_after <= d.imbalance_before ? "better" : "worse" }, fmt(d.imbalance_after)),
    );
    $("ranks-chart").dataset.ranks = n;
    $("ranks-chart").dataset.imbalanceAfter = fmt(d.imbalance_after, 4);
    if (!state.ranksPlot) {
      // ranks are categories: x spans [-0.5, R - 0.5] so the first and last pairs of bars fit,
      // ticks are whole ranks, tokens start at 0; static EP left of each rank, the plan right
      const box = $("ranks-chart");
      state.ranksPlot = new uPlot({
        width: chartWidth("ranks-chart"), height: 230,
        scales: {
          x: { time: false, range: (u) => [-0.5, Math.max(1, u.data[0].length) - 0.5] },
          y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.08 : 1] },
        },
        axes: [{ stroke: "#8a9aab", grid: { show: false }, label: "rank",
                 splits: (u) => ticks(u.data[0].length, 16), values: (u, sp) => sp.map((v) => String(v)) },
               { stroke: "#8a9aab", grid: { stroke: "#263341" }, label: "tokens", size: 60 }],
        series: [{ label: "rank" },
          { label: "static EP", stroke: "#8a9aab", fill: "#8a9aab55", paths: uPlot.paths.bars({ size: [0.4, 40], align: -1 }), points: { show: false } },
          { label: "plan", stroke: "#4fb3ff", fill: "#4fb3ff88", paths: uPlot.paths.bars({ size: [0.4, 40], align: 1 }), points: { show: false } }],
        hooks: { draw: [(u) => {
          box.dataset.xMin = u.scales.x.min; box.dataset.xMax = u.scales.x.max;
          box.dataset.yMin = u.scales.y.min;
          box.dataset.xTicks = ticks(u.data[0].length, 16).join(",");
        }] },
      }, data, $("ranks-chart"));
    } else {
      state.ranksPlot.setData(data);
    }
  }
  function drawTimeline(d) {
    // one point per committed plan: imbalance before / after, balancedness after;
    // plus measured per-step imbalance when the runtime records steps.
    const plans = d.plan_events.filter((p) => p.event === "committed");
    const pts = new Map();
    for (const p of plans) pts.set(p.step, { before: p.imbalance_before, after: p.imbalance_after });
    for (const s of d.steps) {
      const o = pts.get(s.step) || {};
      o.measured = s.imbalance;
      pts.set(s.step, o);
    }
    const xs = [...pts.keys()].sort((a, b) => a - b);
    const pick = (k) => xs.map((x) => (pts.get(x)[k] ?? null));
    const after = pick("after");
    const data = [xs, pick("before"), after, after.map((v) => (v ? 1 / v : null)), pick("measured")];
    $("timeline-chart").dataset.points = xs.length;
    if (!state.timelinePlot) {
      state.timelinePlot = new uPlot({
        width: chartWidth("timeline-chart"), height: 240,
        scales: { x: { time: false } },
        axes: [{ stroke: "#8a9aab", grid: { stroke: "#263341" }, label: "step",
                 incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 1e6] },
               { stroke: "#8a9aab", grid: { stroke: "#263341" } }],
        series: [{ label: "step" },
          { label: "before plan", stroke: "#ff6b6b", width: 2, spanGaps: true },
          { label: "after plan", stroke: "#3ddc97", width: 2, spanGaps: true },
          { label: "balancedness", stroke: "#4fb3ff", width: 1, dash: [4, 4], spanGaps: true },
          { label: "measured", stroke: "#ffa94d", width: 1, spanGaps: true }],
      }, data, $("timeline-chart"));
    } else {
      state.timelinePlot.setData(data);
    }
  }

  // ---- measured balance (SPMD steps): every microbatch's measured max/mean, the
  // planner's level on the same counts, within-DC and cross-DC floor, static EP per step;
  // balancedness per layer of the newest step ----
  function microbatches(x) {
    // [{x, measured, planner, within, floor}] one per microbatch (max over layers); a step
    // that did not say its microbatches is one point at the step
    const mx = (row) => Math.max(...row);
    const planner = x.planner || [];
    if (!x.microbatches || !x.microbatches.length) {
      return [{ x: x.step, measured: x.imbalance, planner: null, within: null, floor: null }];
    }
    const k = x.microbatches.length;
    return x.microbatches.map((row, i) => ({
      x: x.step + i / k, measured: mx(row),
      planner: planner.length ? mx(planner[i]) : null,
      within: x.within_dc.length ? mx(x.within_dc[i]) : null,
      floor: x.floor.length ? mx(x.floor[i]) : null,
    }));
  }
  function drawBalance(d) {
    const b = d.balance, box = $("balance-chart");
    $("balance-note").hidden = b.length > 0;
    const xs = [], meas = [], plan = [], within = [], floor = [], stat = [];
    for (const x of b) {
      microbatches(x).forEach((m, i) => {
        xs.push(m.x); meas.push(m.measured); plan.push(m.planner);
        within.push(m.within); floor.push(m.floor);
        stat.push(i === 0 ? x.imbalance_static : null);
      });
    }
    const data = [xs, meas, plan, within, floor, stat];
    const last = b.length ? b[b.length - 1] : null;
    const lastMb = last ? microbatches(last) : [];
    // what the chart plots, for tests and the curious: the newest point of each series
    box.dataset.points = xs.length;
    box.dataset.lastStep = last ? last.step : "";
    box.dataset.lastMeasured = last ? fmt(meas.at(-1), 4) : "";
    box.dataset.lastStatic = last ? fmt(last.imbalance_static, 4) : "";
    box.dataset.lastPlanner = last && last.imbalance_planner != null ? fmt(last.imbalance_planner, 4) : "";
    box.dataset.lastMicrobatches = lastMb.map((m) => fmt(m.measured, 4)).join(",");
    $("balance-summary").replaceChildren(...(last ? [
      document.createTextNode(`step ${last.step}: measured `), el("b", { class: last.imbalance <= last.imbalance_static ? "better" : "worse" }, fmt(last.imbalance)),
      ...(last.imbalance_planner != null ? [document.createTextNode(" · planner's level "),
        el("b", null, fmt(last.imbalance_planner))] : []),
      document.createTextNode(" vs static EP "), el("b", null, fmt(last.imbalance_static)),
      document.createTextNode(` · ${last.replicas} replicas, ${bytes(last.fanout_bytes)} fanned out, fast loop exposed ${fmt(last.balance_seconds * 1000, 1)} ms of ${fmt(last.seconds * 1000, 0)} ms`),
    ] : []));
    const mbRows = last && last.microbatches.length ? last.microbatches.map((row, i) => {
      const tr = el("tr", { "data-microbatch": i, "data-value": fmt(Math.max(...row), 4) });
      const planner = last.planner || [];
      tr.append(el("td", null, String(i)), el("td", null, row.map((v) => fmt(v)).join(" / ")),
        el("td", null, planner.length ? fmt(Math.max(...planner[i])) : "–"),
        el("td", null, last.within_dc.length ? fmt(Math.max(...last.within_dc[i])) : "–"),
        el("td", null, last.floor.length ? fmt(Math.max(...last.floor[i])) : "–"));
      return tr;
    }) : [];
    $("balance-mb").querySelector("tbody").replaceChildren(...mbRows);
    const rows = last ? last.balancedness.map((v, l) => {
      const row = el("div", { class: "row", "data-layer": l, "data-value": fmt(v, 4) });
      const bar = el("div", { class: "bar" });
      bar.style.width = (Math.max(0, Math.min(1, v)) * 100).toFixed(1) + "%";
      const track = el("div");
      track.appendChild(bar);
      row.append(el("span", { class: "name" }, `layer ${l}`), track, el("span", { class: "val" }, fmt(v)));
      return row;
    }) : [];
    $("balance-layers").replaceChildren(...rows);
    if (!state.balancePlot) {
      state.balancePlot = new uPlot({
        width: chartWidth("balance-chart"), height: 240,
        scales: { x: { time: false } },
        axes: [{ stroke: "#8a9aab", grid: { stroke: "#263341" }, label: "step (microbatches between)" },
               { stroke: "#8a9aab", grid: { stroke: "#263341" }, label: "max/mean" }],
        series: [{ label: "step" },
          { label: "measured", stroke: "#3ddc97", width: 2 },
          { label: "planner level", stroke: "#c792ea", width: 1, spanGaps: true },
          { label: "within DC", stroke: "#4fb3ff", width: 1, spanGaps: true },
          { label: "cross-DC floor", stroke: "#ffa94d", width: 1, dash: [2, 3], spanGaps: true },
          { label: "static EP", stroke: "#ff6b6b", width: 1, dash: [4, 4], spanGaps: true }],
      }, data, box);
    } else {
      state.balancePlot.setData(data);
    }
  }

  // ---- DC map (SVG) ----
  function drawMap(d) {
    const map = $("dc-map");
    clear(map);
    const n = d.dcs.length, cx = 200, cy = 150, R = n > 1 ? 100 : 0;
    const pos = new Map();
    d.dcs.forEach((dc, i) => {
      const a = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(1, n);
      pos.set(dc.name, [cx + R * Math.cos(a), cy + R * Math.sin(a)]);
    });
    const maxTraffic = Math.max(1, ...d.links.map((l) => Math.max(l.token_bytes, l.weight_bytes)));
    const w = (b) => (b > 0 ? 1.5 + 8 * Math.sqrt(b / maxTraffic) : 0);
    for (const l of d.links) {
      const a = pos.get(l.src), b = pos.get(l.dst);
      if (!a || !b) continue;
      const dx = b[0] - a[0], dy = b[1] - a[1], len = Math.hypot(dx, dy) || 1;
      const ox = (-dy / len) * 5, oy = (dx / len) * 5;  // tokens and weights side by side
      if (l.token_bytes <= 0 && l.weight_bytes <= 0) {
        map.appendChild(svg("line", { x1: a[0], y1: a[1], x2: b[0], y2: b[1], class: "idle" }));
        continue;
      }
      if (l.token_bytes > 0) map.appendChild(svg("line", { x1: a[0] + ox, y1: a[1] + oy, x2: b[0] + ox, y2: b[1] + oy, class: "tok", "stroke-width": w(l.token_bytes) }));
      if (l.weight_bytes > 0) map.appendChild(svg("line", { x1: a[0] - ox, y1: a[1] - oy, x2: b[0] - ox, y2: b[1] - oy, class: "wts", "stroke-width": w(l.weight_bytes) }));
    }
    for (const dc of d.dcs) {
      const [x, y] = pos.get(dc.name);
      const g = svg("g", { "data-dc": dc.name });
      g.appendChild(svg("circle", { cx: x, cy: y, r: 30, class: "dc" }));
      const t1 = svg("text", { x: x, y: y - 2, "text-anchor": "middle" }); t1.textContent = dc.name;
      const t2 = svg("text", { x: x, y: y + 12, "text-anchor": "middle" }); t2.textContent = dc.num_ranks + " ranks";
      g.appendChild(t1); g.appendChild(t2);
      map.appendChild(g);
    }
    $("traffic-note").hidden = d.runtime;
    const body = $("links-table").tBodies[0];
    clear(body);
    for (const l of d.links.slice(0, 12)) {
      const tr = el("tr");
      tr.appendChild(el("td", null, `${l.src} ↔ ${l.dst}`));
      // without a runtime nothing measures the links: no figure rather than a 0 B
      tr.appendChild(el("td", null, d.runtime ? bytes(l.token_bytes) : "–"));
      tr.appendChild(el("td", null, d.runtime ? bytes(l.weight_bytes) : "–"));
      tr.appendChild(el("td", null, fmt(l.gbps, 1)));
      body.appendChild(tr);
    }
  }

  // ---- workers ----
  function drawWorkers(d) {
    const box = $("workers");
    clear(box);
    const groups = new Map();
    for (const w of d.workers) {
      if (!groups.has(w.dc)) groups.set(w.dc, []);
      groups.get(w.dc).push(w);
    }
    // with a runtime: worker health (up / down); without (expertmesh serve): what the
    // controller knows, each rank's newest load report
    $("workers-legend").hidden = !d.runtime;
    $("workers-note").hidden = d.runtime;
    const FRESH_S = 30;
    for (const [dc, ws] of groups) {
      const g = el("div", { class: "dc-group" });
      let head;
      if (d.runtime) {
        head = `${dc} · ${ws.filter((w) => w.up === true).length}/${ws.length} up`;
      } else {
        const seen = ws.filter((w) => w.last_report !== null).map((w) => w.last_report);
        const fresh = seen.filter((t) => d.now - t <= FRESH_S).length;
        head = `${dc} · ${fresh}/${ws.length} reporting` +
          (seen.length ? ` · last report ${ago(d.now - Math.max(...seen))}` : " · no report yet");
      }
      g.appendChild(el("div", { class: "dc-name" }, head));
      const grid = el("div", { class: "grid" });
      for (const w of ws) {
        let st, tip;
        if (d.runtime) {
          st = w.up === true ? "up" : w.up === false ? "down" : "unknown";
          tip = st + (w.since ? ` since ${when(w.since)}` : "");
        } else {
          st = w.last_report === null ? "unknown" : d.now - w.last_report <= FRESH_S ? "reporting" : "silent";
          tip = w.last_report === null ? "no load report yet" : `last load report ${ago(d.now - w.last_report)}`;
        }
        const dot = el("span", { class: "dot " + st, "data-rank": w.rank });
        dot.title = `rank ${w.rank}: ${tip}`;
        grid.appendChild(dot);
      }
      g.appendChild(grid);
      box.appendChild(g);
    }
  }

  // ---- plans and diffs ----
  function drawPlans(d) {
    const body = $("plans-table").tBodies[0];
    clear(body);
    for (const p of d.plans) {
      const tr = el("tr", { "data-version": p.version });
      if (p.version === state.selected) tr.classList.add("selected");
      const b = Math.max(...p.imbalance_before), a = Math.max(...p.imbalance_after);
      tr.appendChild(el("td", null, "v" + p.version));
      tr.appendChild(el("td", null, p.step));
      tr.appendChild(el("td", null, p.policy));
      const td = el("td");
      td.appendChild(document.createTextNode(fmt(b) + " → "));
      td.appendChild(el("span", { class: a <= b ? "better" : "worse" }, fmt(a)));
      tr.appendChild(td);
      tr.appendChild(el("td", null, p.migrations));
      tr.appendChild(el("td", null, bytes(p.migration_bytes)));
      tr.appendChild(el("td", null, (p.solve_seconds * 1000).toFixed(1) + " ms"));
      tr.appendChild(el("td", null, when(p.committed_at)));
      tr.addEventListener("click", () => showDiff(p.version));
      body.appendChild(tr);
    }
  }
  async function showDiff(version) {
    state.selected = version;
    const box = $("plan-diff");
    clear(box);
    box.hidden = false;
    if (version <= 1) { box.appendChild(el("p", null, `v${version} is the first plan: nothing to diff against.`)); return; }
    try {
      const r = await fetch(`/api/v1/plans/diff?from=${version - 1}&to=${version}`);
      const d = await r.json();
      if (!r.ok) { box.appendChild(el("p", { class: "worse" }, d.error || r.statusText)); return; }
      box.appendChild(el("h3", null, `v${d.from_version} → v${d.to_version}: ${d.changed_slots} slots changed, ${d.migrations} migrations, ${bytes(d.migration_bytes)}`));
      const cols = el("div", { class: "cols" });
      const slots = el("table", { class: "mini" });
      slots.appendChild(el("thead")).appendChild(el("tr")).append(el("th", null, "layer"), el("th", null, "rank/slot"), el("th", null, "expert before → after"));
      const mig = el("table", { class: "mini" });
      mig.appendChild(el("thead")).appendChild(el("tr")).append(el("th", null, "layer"), el("th", null, "expert"), el("th", null, "src → dst"), el("th", null, "round"), el("th", null, "bytes"));
      const sb = slots.appendChild(el("tbody")), mb = mig.appendChild(el("tbody"));
      const MAX_ROWS = 12;
      let ns = 0, nm = 0;
      for (const L of d.layers) {
        for (const c of L.changed_slots) {
          if (ns++ < MAX_ROWS) sb.appendChild(el("tr")).append(el("td", null, L.layer), el("td", null, `${c.rank}/${c.slot}`), el("td", null, `${c.before} → ${c.after}`));
        }
        for (const m of L.migrations) {
          if (nm++ < MAX_ROWS) mb.appendChild(el("tr")).append(el("td", null, L.layer), el("td", null, m.expert), el("td", null, `${m.src_rank} → ${m.dst_rank}`), el("td", null, m.round), el("td", null, bytes(m.nbytes)));
        }
      }
      if (ns > MAX_ROWS) sb.appendChild(el("tr")).append(el("td", { colspan: 3 }, `… ${ns - MAX_ROWS} more`));
      if (nm > MAX_ROWS) mb.appendChild(el("tr")).append(el("td", { colspan: 5 }, `… ${nm - MAX_ROWS} more`));
      cols.append(slots, mig);
      box.appendChild(cols);
    } catch (err) {
      box.appendChild(el("p", { class: "worse" }, "diff failed: " + err));
    }
  }

  // ---- loop ----
  function fillLayers(n) {
    if (n === state.numLayers) return;
    state.numLayers = n;
    const sel = $("layer-select");
    clear(sel);
    for (let i = 0; i < n; i++) sel.appendChild(el("option", { value: i }, i));
    sel.value = String(state.layer);
  }
  $("layer-select").addEventListener("change", (ev) => { state.layer = Number(ev.target.value) || 0; poll(); });

  function render(d) {
    $("kpi-policy").textContent = d.policy;
    $("kpi-version").textContent = d.plan_version ? "v" + d.plan_version : "none";
    const known = d.layer_imbalance.filter((v) => v !== null);  // null: no load yet
    const worst = known.length ? Math.max(...known) : NaN;
    const at = known.length ? ` (layer ${d.layer_imbalance.indexOf(worst)})` : "";
    $("kpi-imbalance").textContent = fmt(worst) + at;
    $("kpi-balancedness").textContent = fmt(worst ? 1 / worst : NaN) + at;
    $("kpi-reports").textContent = d.reports_received.toLocaleString();
    $("kpi-rejected").textContent = d.reports_rejected.toLocaleString();
    fillLayers(d.heatmap.length);
    drawHeatmap(d.heatmap);
    drawRanks(d);
    drawTimeline(d);
    drawBalance(d);
    drawMap(d);
    drawWorkers(d);
    drawPlans(d);
    document.body.dataset.planVersion = d.plan_version;
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
    if (!document.body.dataset.firstRenderMs) document.body.dataset.firstRenderMs = performance.now().toFixed(0);
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  }

  let inflight = false;
  async function poll() {
    if (inflight) return;
    inflight = true;
    const status = $("status");
    try {
      const r = await fetch(`/api/v1/dashboard?layer=${state.layer}`, { cache: "no-store" });
      if (!r.ok) throw new Error((await r.json()).error || r.statusText);
      render(await r.json());
      status.dataset.state = "live"; status.textContent = "live";
    } catch (err) {
      status.dataset.state = "error"; status.textContent = "error: " + err.message;
    } finally {
      inflight = false;
    }
  }
  window.addEventListener("resize", () => {
    if (state.ranksPlot) state.ranksPlot.setSize({ width: chartWidth("ranks-chart"), height: 230 });
    if (state.timelinePlot) state.timelinePlot.setSize({ width: chartWidth("timeline-chart"), height: 240 });
    if (state.balancePlot) state.balancePlot.setSize({ width: chartWidth("balance-chart"), height: 240 });
  });
  poll();
  setInterval(poll, POLL_MS);
})();
