// asyncrl dashboard page logic. "/" shows the runs in this Redis; "/run/{run}" loads the run's
// whole history from /api/run/{run}/series, then follows /api/run/{run}/stream (server-sent
// events, one update a second) and redraws. A finished run (`asyncrl dashboard RUN_DIR`: the
// summary says mode "finished") is loaded once and marked as such; nothing to follow. Everything
// shown comes from the JSON the server builds; this file only formats and draws it.
"use strict";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];

// One entry per chart: which metrics it draws, and an optional dashed reference line taken from
// the run summary (the configured bound or alert threshold).
const CHARTS = [
  { id: "versions", title: "Policy version", metrics: [["learner/version", "policy version"]], yTitle: "version",
    extra: generatorVersionTraces },
  { id: "staleness", title: "Staleness of trained groups", yTitle: "versions",
    metrics: [["staleness/mean", "mean"], ["staleness/p50", "p50"], ["staleness/p90", "p90"], ["staleness/max", "max"]],
    refLine: s => s.max_staleness == null ? null : { y: s.max_staleness, label: "max_staleness" } },
  { id: "staleness-hist", title: "Staleness distribution (fraction of groups)", yTitle: "fraction", stacked: true,
    palette: ["#1e40af", "#60a5fa", "#fbbf24", "#f97316", "#dc2626", "#7f1d1d"],
    metricsFrom: names => names.filter(n => /^staleness\/frac_\d+$/.test(n))
      .sort((a, b) => +a.split("_").pop() - +b.split("_").pop())
      .map(n => [n, "staleness " + n.split("_").pop()]) },
  { id: "queue", title: "Queue", yTitle: "groups",
    metrics: [["queue/depth", "depth"], ["queue/pending", "pending"], ["queue/dropped_stale", "dropped stale"],
              ["queue/dead_lettered", "dead-lettered"], ["rollout/dropped_uniform_groups", "dropped uniform"]] },
  { id: "drift", title: "Train / rollout drift",
    metrics: [["drift/rollout_kl", "rollout KL (k3)"], ["drift/abs_logp_diff", "mean |Δlogp|"]],
    refLine: s => ({ y: s.thresholds.rollout_kl, label: "KL alert" }) },
  { id: "logprob-diff", title: "Learner / engine parity: max |old − rollout logprob|", yTitle: "nats",
    // The start-up gate (once per start or resume, before any update): a marker where it ran.
    metrics: [["drift/logprob_abs_diff_max", "max |Δlogp|"], ["parity/gate_max_abs_diff", "start-up gate"]],
    markerMetrics: ["parity/gate_max_abs_diff"],
    refLine: s => ({ y: s.thresholds.logprob_diff_max, label: "parity alert" }) },
  { id: "tis", title: "Importance ratio exp(old − rollout)",
    metrics: [["drift/tis_ratio_mean", "mean"], ["drift/tis_ratio_max", "max"], ["drift/tis_capped_frac", "capped frac"]] },
  { id: "masks", title: "Masked and clipped fractions", yTitle: "fraction",
    metrics: [["drift/masked_frac", "masked (any)"], ["drift/geo_masked_frac", "geo mask"],
              ["drift/product_masked_frac", "product mask"], ["drift/outlier_masked_frac", "outlier mask"],
              ["drift/tis_capped_frac", "TIS capped"], ["policy/clip_frac", "policy clip"]],
    refLine: s => ({ y: s.thresholds.masked_frac, label: "mask alert" }) },
  { id: "throughput", title: "Throughput", yTitle: "tokens/s",
    metrics: [["throughput/gen_tokens_per_s", "generation"], ["throughput/train_tokens_per_s", "training"]] },
  { id: "reward-failures", title: "Failed rewards at the generators (so far)", yTitle: "calls",
    metrics: [["rollout/reward_errors", "raised"], ["rollout/reward_timeouts", "timed out"]] },
  { id: "weight-loads", title: "Failed weight loads at the generators (so far)", yTitle: "loads",
    metrics: [["sync/load_failures", "failed loads"]] },
  { id: "time", title: "Step time split", yTitle: "seconds", stacked: true,
    palette: ["#f59e0b", "#2563eb", "#16a34a"],
    metrics: [["time/wait_data", "wait for data"], ["time/train", "train"], ["time/sync", "weight sync"]] },
  { id: "reward", title: "Reward and response length", yTitle: "reward", y2Title: "tokens",
    metrics: [["reward/mean", "reward mean"], ["reward/std", "reward std"], ["response/length_mean", "length", "y2"]] },
  { id: "loss", title: "Loss terms",
    metrics: [["loss/total", "total"], ["loss/policy", "policy"], ["loss/kl_ref", "KL ref"],
              ["loss/rollout_kl", "rollout KL"], ["loss/entropy", "entropy"]] },
  // Logged only every control.eval_every steps: markers, so a lone point shows.
  { id: "eval", title: "Evaluation on held-out prompts", yTitle: "reward", y2Title: "tokens", markers: true,
    nodata: "no evaluation logged (control.eval_every = 0, or none due yet)",
    metrics: [["eval/reward_mean", "eval reward mean"], ["eval/reward_std", "eval reward std"],
              ["eval/response_length_mean", "eval length", "y2"]] },
];

const view = { run: null, series: {}, lastId: null, snapshot: null, source: null, dirty: false };

// ------------------------------------------------------------------ formatting

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en-US");
  if (Number.isInteger(v)) return String(v);
  return String(Number(v.toPrecision(3)));
}

function fmtAge(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function fmtTime(unix) {
  return unix ? new Date(unix * 1000).toLocaleString() : "–";
}

function setText(id, text) {
  const el = document.getElementById(id);
  if (el) el.textContent = text;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

async function getJSON(url) {
  const r = await fetch(url, { credentials: "same-origin" });
  const body = await r.json().catch(() => ({ message: r.statusText }));
  if (!r.ok) throw new Error(body.message || body.error || r.statusText);
  return body;
}

// ------------------------------------------------------------------ runs page

async function showRuns() {
  document.getElementById("runs-view").hidden = false;
  setText("run-name", "all runs");
  try {
    const { runs } = await getJSON("/api/runs");
    const body = document.querySelector("#runs-table tbody");
    body.replaceChildren(...runs.map(r => el("tr", { "data-run": r.run },
      el("td", {}, el("a", { href: `/run/${encodeURIComponent(r.run)}` }, r.run)),
      el("td", {}, el("span", { class: `pill status-${r.status}` }, r.status)),
      el("td", {}, fmt(r.policy_version)), el("td", {}, fmt(r.step)), el("td", {}, fmt(r.reward_mean)),
      el("td", {}, r.generators),
      el("td", {}, r.alerts ? el("span", { class: "pill alert" }, r.alerts) : "0"),
      el("td", {}, fmtTime(r.started_at)))));
    document.getElementById("runs-empty").hidden = runs.length > 0;
    setConn(true, "connected");
  } catch (e) {
    showError(e.message);
  }
}

// ------------------------------------------------------------------ run page: data

function mergeSeries(update) {
  for (const [name, s] of Object.entries(update)) {
    const cur = view.series[name] || (view.series[name] = { step: [], time: [], value: [], source: [] });
    for (const k of ["step", "time", "value", "source"]) cur[k].push(...s[k]);
  }
}

// Points of one metric split by source ("trainer" first, then each generator id).
function tracesOf(name, label, color, axis) {
  const s = view.series[name];
  if (!s) return [];
  const bySource = {};
  s.source.forEach((src, i) => {
    const t = bySource[src] || (bySource[src] = { x: [], y: [] });
    t.x.push(s.step[i]); t.y.push(s.value[i]);
  });
  return Object.keys(bySource).sort((a, b) => (a === "trainer" ? -1 : b === "trainer" ? 1 : a.localeCompare(b)))
    .map(src => ({
      x: bySource[src].x, y: bySource[src].y, name: src === "trainer" ? label : `${label} (${src})`,
      type: "scatter", mode: "lines", line: { color, width: 2 }, yaxis: axis || "y",
    }));
}

function generatorVersionTraces() {
  const gens = (view.snapshot && view.snapshot.generators) || [];
  const step = view.snapshot && view.snapshot.summary.step;
  if (step == null || !gens.length) return [];
  return [{
    x: gens.map(() => step), y: gens.map(g => g.version), text: gens.map(g => `${g.id}: v${g.version} (lag ${g.lag})`),
    name: "generators now", type: "scatter", mode: "markers", hoverinfo: "text",
    marker: { size: 10, symbol: "diamond", color: gens.map(g => (g.status === "ok" ? "#16a34a" : "#dc2626")) },
  }];
}

// ------------------------------------------------------------------ run page: drawing

const LAYOUT = {
  margin: { l: 52, r: 16, t: 30, b: 40 }, height: 260, showlegend: true,
  legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom", traceorder: "normal", font: { size: 11 } },
  xaxis: { title: { text: "step", font: { size: 11 } }, gridcolor: "#eef0f3", zeroline: false },
  yaxis: { gridcolor: "#eef0f3", zeroline: false, rangemode: "tozero" },
  paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)", font: { family: "system-ui, sans-serif", size: 11 },
};

function buildCharts() {
  const grid = document.getElementById("charts");
  grid.replaceChildren(...CHARTS.map(c => el("div", { class: "panel", id: `panel-${c.id}` },
    el("h2", {}, c.title), el("div", { class: "chart", id: `chart-${c.id}` }),
    el("p", { class: "muted nodata", id: `nodata-${c.id}` }, c.nodata || "no data yet"))));
}

function drawChart(c) {
  const metrics = c.metricsFrom ? c.metricsFrom(Object.keys(view.series)) : c.metrics;
  let traces = [];
  const palette = c.palette || PALETTE;
  const markerOnly = new Set(c.markerMetrics || []);
  metrics.forEach(([name, label, axis], i) => {
    const color = palette[i % palette.length];
    traces.push(...tracesOf(name, label, color, axis).map(t => markerOnly.has(name)
      ? { ...t, mode: "markers", marker: { color, size: 11, symbol: "star" } } : t));
  });
  if (c.markers) traces = traces.map(t => ({ ...t, mode: "lines+markers", marker: { color: t.line.color, size: 6 } }));
  if (c.stacked) traces = traces.map(t => ({ ...t, type: "bar", mode: undefined, line: undefined,
                                             marker: { color: t.line.color } }));
  const hasData = traces.length > 0;
  if (c.extra) traces.push(...c.extra());
  const layout = JSON.parse(JSON.stringify(LAYOUT));
  if (c.stacked) layout.barmode = "stack";
  if (c.yTitle) layout.yaxis.title = { text: c.yTitle, font: { size: 11 } };
  if (c.y2Title) layout.margin.r = 52;
  if (c.y2Title) layout.yaxis2 = { overlaying: "y", side: "right", title: { text: c.y2Title, font: { size: 11 } },
                                   showgrid: false, rangemode: "tozero" };
  const ref = c.refLine && view.snapshot ? c.refLine(view.snapshot.summary) : null;
  if (ref && ref.y != null) {
    layout.shapes = [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: ref.y, y1: ref.y,
                       line: { color: "#dc2626", dash: "dash", width: 1.5 } }];
    layout.annotations = [{ xref: "paper", x: 1, y: ref.y, text: `${ref.label} ${fmt(ref.y)}`, showarrow: false,
                            xanchor: "right", yanchor: "bottom", font: { color: "#dc2626", size: 10 } }];
  }
  const nodata = document.getElementById(`nodata-${c.id}`);
  nodata.hidden = hasData;
  if (view.snapshot && view.snapshot.summary.finished) nodata.textContent = "not logged by this run";
  Plotly.react(`chart-${c.id}`, traces, layout, { displaylogo: false, responsive: true,
                                                  modeBarButtonsToRemove: ["lasso2d", "select2d"] });
}

function drawTiles(snap) {
  const s = snap.summary, m = s.latest, c = s.counters;
  setText("run-name", s.run);
  const status = document.getElementById("run-status");
  status.hidden = false; status.textContent = s.status; status.className = `pill status-${s.status}`;
  setText("run-meta", [s.groups_per_step != null ? `${s.groups_per_step} groups/step` : null,
                       s.started_at ? `started ${fmtTime(s.started_at)}` : null].filter(Boolean).join(" · "));
  setText("stat-policy-version", fmt(s.policy_version));
  setText("stat-weights-version", s.weights_version != null ? `weights published: v${s.weights_version}` : "");
  setText("stat-step", fmt(s.step));
  setText("stat-uptime", s.finished ? (s.finished.wall_s != null ? `wall time ${fmtDuration(s.finished.wall_s)}` : "")
    : s.uptime_s != null && s.status === "running" ? `up ${Math.round(s.uptime_s / 60)} min` : "");
  setText("stat-reward", fmt(m["reward/mean"]));
  setText("stat-length", m["response/length_mean"] != null ? `length ${fmt(m["response/length_mean"])} tokens` : "");
  setText("stat-staleness-mean", fmt(m["staleness/mean"]));
  setText("stat-staleness-max", fmt(m["staleness/max"]));
  setText("stat-staleness-bound", s.max_staleness != null ? `bound: max_staleness = ${s.max_staleness}` : "");
  setText("stat-rollout-kl", fmt(m["drift/rollout_kl"]));
  setText("stat-rollout-kl-alert", `alert above ${fmt(s.thresholds.rollout_kl)}`);
  setText("stat-masked", fmt(m["drift/masked_frac"]));
  setText("stat-masked-alert", `alert above ${fmt(s.thresholds.masked_frac)}`);
  setText("stat-gen-tps", fmt(m["throughput/gen_tokens_per_s"]));
  setText("stat-train-tps", fmt(m["throughput/train_tokens_per_s"]));
  setText("stat-queue-depth", fmt(m["queue/depth"]));
  setText("stat-queue-pending", m["queue/pending"] != null ? `${fmt(m["queue/pending"])} pending ack` : "");
  setText("stat-dropped", fmt(c.dropped_stale));
  setText("stat-dead", fmt(c.dead_lettered));
  setText("stat-uniform", fmt(c.dropped_uniform));
  setText("stat-trained", fmt(c.groups_trained));
  setText("stat-produced", `${fmt(c.groups_produced)} produced · ${fmt(c.groups_started)} started`);
  const kinds = new Set(snap.alerts.map(a => a.kind));
  document.getElementById("tile-rollout-kl").classList.toggle("alerting", kinds.has("rollout_kl"));
  document.getElementById("tile-masked").classList.toggle("alerting", kinds.has("masked_frac"));
  document.getElementById("tile-staleness").classList.toggle("alerting", kinds.has("staleness"));
}

function drawAlerts(alerts) {
  const box = document.getElementById("alerts");
  if (!alerts.length) {
    box.replaceChildren(el("span", { class: "badge ok", id: "no-alerts" }, "✓ no alerts"));
    return;
  }
  box.replaceChildren(...alerts.map(a => el("span", { class: "badge alert", "data-kind": a.kind }, "⚠ " + a.message)));
}

function drawGenerators(gens) {
  setText("gen-count", gens.length ? `(${gens.length})` : "");
  document.getElementById("gen-empty").hidden = gens.length > 0;
  document.querySelector("#gen-table tbody").replaceChildren(...gens.map(g => el("tr", { "data-generator": g.id },
    el("td", {}, g.id), el("td", {}, el("span", { class: `pill gen-${g.status}` }, g.status)),
    el("td", { class: "num" }, fmt(g.version)), el("td", { class: "num lag" }, fmt(g.lag)),
    el("td", {}, fmtAge(g.heartbeat_age_s)), el("td", { class: "num" }, fmt(g.groups)),
    el("td", { class: "num" }, fmt(g.tokens_per_s)))));
}

function fmtDuration(seconds) {
  if (seconds < 120) return `${seconds.toFixed(1)} s`;
  if (seconds < 7200) return `${(seconds / 60).toFixed(1)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

// A finished run: say so, with what it ended at and where the numbers come from.
function drawFinished(s) {
  const f = s.finished;
  const b = document.getElementById("finished-banner");
  b.hidden = !f;
  document.getElementById("gen-panel").hidden = !!f;  // no generator outlives its run
  if (!f) return;
  const parts = [`Finished run (${s.status}): final step ${fmt(f.final_step)}`,
                 f.wall_s != null ? `wall time ${fmtDuration(f.wall_s)}` : null,
                 f.startup_s != null ? `start-up ${fmtDuration(f.startup_s)}` : null,
                 f.ended_at ? `ended ${fmtTime(f.ended_at)}` : null,
                 f.checkpoint ? `last checkpoint ${f.checkpoint}` : null].filter(Boolean);
  let text = parts.join(" · ") + `. Read from ${f.run_dir}`;
  if (!f.has_summary && f.metrics_age_s < 60) {
    text += ` (metrics.jsonl changed ${Math.round(f.metrics_age_s)} s ago: the run may still be going;` +
            " its live page is the URL it printed)";
  } else if (!f.has_summary) {
    text += " (no summary.json: the run ended before its summary, killed or crashed)";
  }
  b.textContent = text + ".";
}

function redraw() {
  if (!view.dirty) return;
  view.dirty = false;
  if (view.snapshot) {
    drawFinished(view.snapshot.summary);
    drawTiles(view.snapshot);
    drawAlerts(view.snapshot.alerts);
    drawGenerators(view.snapshot.generators);
  }
  CHARTS.forEach(drawChart);
}

// ------------------------------------------------------------------ run page: live updates

function setConn(ok, text) {
  const c = document.getElementById("conn");
  c.classList.toggle("ok", ok); c.classList.toggle("bad", !ok);
  setText("conn-text", text);
}

function showError(message) {
  const b = document.getElementById("error-banner");
  if (b) { b.hidden = !message; b.textContent = message || ""; }
  if (message) setConn(false, "error");
}

function follow() {
  const since = view.lastId ? `?since=${encodeURIComponent(view.lastId)}` : "";
  const src = new EventSource(`/api/run/${encodeURIComponent(view.run)}/stream${since}`);
  view.source = src;
  src.addEventListener("update", ev => {
    const u = JSON.parse(ev.data);
    mergeSeries(u.series);
    view.lastId = u.last_id;
    view.snapshot = u;
    view.dirty = true;
    showError(null);
    setConn(true, u.summary.status === "running" ? "live" : u.summary.status);
  });
  src.addEventListener("failure", ev => showError(JSON.parse(ev.data).error));
  src.onerror = () => {
    // Reconnect ourselves from the last id we have, so no point is drawn twice.
    src.close();
    setConn(false, "reconnecting");
    setTimeout(follow, 2000);
  };
}

async function showRun(run) {
  view.run = run;
  document.getElementById("run-view").hidden = false;
  setText("run-name", run);
  buildCharts();
  try {
    const [series, summary, gens, alerts] = await Promise.all([
      getJSON(`/api/run/${encodeURIComponent(run)}/series`),
      getJSON(`/api/run/${encodeURIComponent(run)}/summary`),
      getJSON(`/api/run/${encodeURIComponent(run)}/generators`),
      getJSON(`/api/run/${encodeURIComponent(run)}/alerts`),
    ]);
    mergeSeries(series.series);
    view.lastId = series.last_id;
    view.snapshot = { summary, generators: gens.generators, alerts: alerts.alerts };
    view.dirty = true;
    redraw();
    if (summary.mode === "finished") {
      setConn(true, "finished");
      return;  // the files do not change: nothing to follow
    }
  } catch (e) {
    showError(e.message);
  }
  follow();
  setInterval(redraw, 500);
}

const match = location.pathname.match(/^\/run\/([^/]+)\/?$/);
if (match) showRun(decodeURIComponent(match[1])); else showRuns();
