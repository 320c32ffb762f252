"use strict";
// The dashboard page: a runs table, one run's charts and incidents, and several runs compared. Everything it
// shows comes from the JSON API of the same server; the token, when the server asks for one, comes from the
// page's own address (?token=...).

const TOKEN = new URLSearchParams(location.search).get("token");
const POLL_MS = 3000;
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
                "#4b5563", "#ea580c", "#0d9488", "#9333ea"];
const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
// Per-layer statistics span decades: their log axes are labelled by them (10⁻³, 10⁻², with 2 and 5 between).
const LOG_AXIS = { type: "log", dtick: "D2", exponentformat: "power" };
let timer = null;
let stream = null;

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (TOKEN) headers["Authorization"] = "Bearer " + TOKEN;
  const response = await fetch("api/" + path, { ...options, headers });
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const enc = encodeURIComponent;
// Plotly renders tags in hover labels, legends and titles (<b>, <a href>, <br>): text from a run's files is
// shown as written, a traceback's <module> included.
const plain = (text) => String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
function num(v, digits = 4) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e6) return v.toLocaleString();
  const a = Math.abs(v);
  if (a >= 1e12) return (v / 1e12).toFixed(2) + "T";
  if (a >= 1e9) return (v / 1e9).toFixed(2) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
  if (a !== 0 && (a < 1e-3)) return v.toExponential(2);
  return v.toFixed(digits);
}
const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%");
const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "–");

function showError(message) {
  const box = document.getElementById("error");
  box.textContent = message;
  box.hidden = false;
  setTimeout(() => (box.hidden = true), 6000);
}

function setLive(on) { document.getElementById("live").hidden = !on; }

function stop() {
  if (timer) clearInterval(timer);
  if (stream) stream.close();
  timer = stream = null;
  setLive(false);
}

async function route() {
  stop();
  closeEvidence();
  const hash = location.hash.slice(1) || "/";
  const [path, query] = hash.split("?");
  const main = document.getElementById("main");
  try {
    if (path.startsWith("/run/")) await runView(main, decodeURIComponent(path.slice(5)));
    else if (path === "/compare") await compareView(main, new URLSearchParams(query || ""));
    else await runsView(main);
  } catch (err) {
    main.replaceChildren(el("p", { class: "muted" }, "Could not load: " + err.message));
  }
}

// -- runs ------------------------------------------------------------------------------------------------
async function runsView(main) {
  const { project, runs } = await api("runs");
  document.getElementById("project").textContent = project;
  const picked = new Set();
  const compare = el("button", { id: "compare-button", disabled: true, onclick: () => {
    location.hash = "#/compare?runs=" + [...picked].map(enc).join(",");
  } }, "Compare selected");
  const rows = runs.map((r) => {
    const box = el("input", { type: "checkbox", "data-run": r.name, onclick: (e) => {
      e.stopPropagation();
      e.target.checked ? picked.add(r.name) : picked.delete(r.name);
      compare.disabled = picked.size < 2;
    } });
    const forecast = r.forecast ? `${num(r.forecast.final_loss)} [${num(r.forecast.low)}, ${num(r.forecast.high)}]` : "–";
    return el("tr", { class: "clickable", "data-run": r.name, onclick: () => (location.hash = "#/run/" + enc(r.name)) },
      el("td", {}, box), el("td", {}, el("a", { href: "#/run/" + enc(r.name) }, r.name)),
      el("td", {}, el("span", { class: "badge " + r.status }, r.status)),
      el("td", { class: "num" }, num(r.step)), el("td", { class: "num" }, num(r.tokens)),
      el("td", { class: "num" }, num(r.final_loss ?? r.loss)), el("td", { class: "num" }, num(r.val_loss)),
      el("td", { class: "num" }, pct(r.goodput)), el("td", { class: "num" }, num(r.incidents)),
      el("td", { class: "num" }, forecast), el("td", {}, when(r.started)));
  });
  const head = ["", "run", "status", "step", "tokens", "loss", "val loss", "goodput", "incidents",
                "forecast (final loss)", "started"];
  main.replaceChildren(
    el("div", { class: "toolbar" }, el("h1", {}, `Runs (${runs.length})`), compare),
    runs.length ? el("table", { id: "runs" }, el("thead", {}, el("tr", {}, head.map((h, i) =>
      el("th", { class: i >= 3 && i <= 9 ? "num" : "" }, h)))), el("tbody", {}, rows))
      : el("p", { class: "muted" }, "No runs here yet: train one with liandan train CONFIG."));
  if (runs.some((r) => r.status === "running")) {
    setLive(true);
    timer = setInterval(() => api("runs").then((fresh) => {
      if (fresh.runs.length !== runs.length || fresh.runs.some((r, i) => r.step !== runs[i].step)) route();
    }).catch(() => {}), POLL_MS);
  }
}

// -- one run ---------------------------------------------------------------------------------------------
function stat(label, value) {
  return el("div", { class: "stat" }, el("div", { class: "label" }, label), el("div", { class: "value" }, value));
}

function chartBox(id, title) {
  return el("div", { class: "card" }, el("h2", {}, title), el("div", { class: "chart", id }));
}

function layout(extra = {}) {
  // the toolbar stands upright in the right margin: across the top it covered legends and titles
  return { margin: { l: 60, r: 40, t: 10, b: 40 }, hovermode: "closest", showlegend: true, modebar: { orientation: "v" },
           legend: { orientation: "h", y: 1.12 }, xaxis: { title: { text: "step" }, zeroline: false }, ...extra };
}

// A chart of one logged step: plotly would span x-1..x+1 (99..101); from 0 it reads as a step count.
function oneStepAxis(traces) {
  const xs = new Set(traces.flatMap((t) => (t.name === "incidents" ? [] : t.x || [])).filter((x) => typeof x === "number"));
  if (xs.size !== 1) return {};
  const [x] = xs;
  return { xaxis: { title: { text: "step" }, zeroline: false, range: [Math.min(0, 2 * x), Math.max(1, 2 * x)] } };
}

// The run's incident count takes a failure and its restart as one; the table lists both.
function incidentsTitle(incidents) {
  const restarts = incidents.filter((i) => i.kind === "restart").length;
  return restarts ? `Incidents (${incidents.length - restarts}) and restarts (${restarts})` : `Incidents (${incidents.length})`;
}

function incidentShapes(incidents) {
  return incidents.filter((i) => i.step !== null && i.step !== undefined).map((i) => ({
    type: "line", xref: "x", yref: "paper", x0: i.step, x1: i.step, y0: 0, y1: 1,
    line: { color: "rgba(220,38,38,0.45)", width: 1, dash: "dot" } }));
}

function incidentTrace(incidents) {
  const marked = incidents.filter((i) => i.step !== null && i.step !== undefined);
  return { name: "incidents", x: marked.map((i) => i.step), y: marked.map(() => 0.95), yaxis: "y2",
           mode: "markers", type: "scatter", customdata: marked.map((i) => i.seq),
           text: marked.map((i) => plain(`${i.kind} at step ${i.step}: ${i.line}`)), hoverinfo: "text",
           marker: { symbol: "triangle-down", size: 15, color: "#dc2626", line: { color: "#fff", width: 1 } } };
}

async function curve(name, key, points = 2000) {
  return api(`runs/${enc(name)}/curve?key=${enc(key)}&x=step&max_points=${points}`);
}

async function drawRunCharts(name, run, incidents, evaluations) {
  const keys = new Set(run.metric_keys);
  const shapes = incidentShapes(incidents);
  const fetchKey = (k) => (keys.has(k) ? curve(name, k) : Promise.resolve(null));
  const [loss, lr, tps, mfu, gnorm] = await Promise.all(["loss", "lr", "tokens_per_s", "mfu", "grad_norm"].map(fetchKey));
  const line = (c, label, color, extra = {}) => ({ name: label, x: c.x, y: c.y, type: "scatter", mode: "lines",
                                                   line: { color, width: 1.6 }, ...extra });
  const lossTraces = [];
  if (loss) lossTraces.push(line(loss, "train loss", COLORS[0]));
  const evals = evaluations.filter((e) => e.kind === "eval" && typeof e.loss === "number");
  if (evals.length) lossTraces.push({ name: "validation loss", x: evals.map((e) => e.step), y: evals.map((e) => e.loss),
                                      mode: "lines+markers", type: "scatter", line: { color: COLORS[2], width: 2 } });
  // a mixture's validation loss per source (val/<source>/loss), beside the mixture's
  const sourceKeys = [...keys].filter((k) => /^val\/.+\/loss$/.test(k)).sort();
  const sources = await Promise.all(sourceKeys.map((k) => curve(name, k)));
  sources.forEach((c, i) => lossTraces.push(line(c, `validation loss: ${sourceKeys[i].slice(4, -5)}`,
    COLORS[(i + 6) % COLORS.length], { mode: "lines+markers" })));
  const f = run.forecast;
  if (f && typeof f.final_loss === "number" && f.total_steps) {
    lossTraces.push({ name: "forecast (final loss)", x: [f.total_steps], y: [f.final_loss], mode: "markers",
      type: "scatter", marker: { color: COLORS[4], size: 9, symbol: "diamond" },
      error_y: { type: "data", symmetric: false, array: [f.high - f.final_loss], arrayminus: [f.final_loss - f.low] } });
  }
  lossTraces.push(incidentTrace(incidents));
  await Plotly.react("chart-loss", lossTraces, layout({ shapes, ...oneStepAxis(lossTraces), yaxis: { title: { text: "loss" } },
    yaxis2: { overlaying: "y", range: [0, 1], visible: false, fixedrange: true } }), PLOT_CONFIG);
  const chart = document.getElementById("chart-loss");
  if (!chart.dataset.bound) {
    chart.dataset.bound = "1";
    chart.on("plotly_click", (ev) => {
      const point = ev.points.find((p) => p.data.name === "incidents");
      if (point) showIncident(name, point.customdata);
    });
  }
  const simple = (id, c, label, color, extra = {}) => Plotly.react(id, c ? [line(c, label, color)] : [],
    layout({ shapes, showlegend: false, ...oneStepAxis(c ? [c] : []), yaxis: { title: { text: label }, ...extra } }),
    PLOT_CONFIG);
  await simple("chart-lr", lr, "learning rate", COLORS[4], { exponentformat: "e" });
  await simple("chart-tps", tps, "tokens/s", COLORS[5]);
  await simple("chart-mfu", mfu, "MFU", COLORS[3], { tickformat: ".3~%" });  // ".0%" repeated "2%, 2%, 1%"
  await simple("chart-gnorm", gnorm, "gradient norm", COLORS[6]);
}

async function runView(main, name) {
  const load = () => Promise.all([api(`runs/${enc(name)}`), api(`runs/${enc(name)}/incidents`),
                                  api(`runs/${enc(name)}/evaluations`)]);
  let [run, { incidents }, { evaluations }] = await load();
  const [{ checkpoints }, health, { records: layers }] = await Promise.all([api(`runs/${enc(name)}/checkpoints`),
    api(`runs/${enc(name)}/health`), api(`runs/${enc(name)}/layers`)]);
  // Only a mixture of experts logs its experts' loads (moe/<layer>/expert/<e>): the heat map is its alone.
  const experts = run.metric_keys.some((k) => EXPERT_KEY.test(k)) ? await api(`runs/${enc(name)}/experts`) : null;
  document.getElementById("project").textContent = run.name;
  const stats = el("div", { class: "stats", id: "stats" });
  const fillStats = (r) => stats.replaceChildren(
    stat("status", el("span", { class: "badge " + r.status }, r.status)), stat("step", num(r.step)),
    stat("tokens", num(r.tokens)), stat("loss", num(r.final_loss ?? r.loss)), stat("val loss", num(r.val_loss)),
    stat("goodput", pct(r.goodput)), stat("restarts", num(r.restarts)), stat("incidents", num(r.incidents)),
    stat("forecast", r.forecast ? num(r.forecast.final_loss) : "–"));
  fillStats(run);
  const incidentRows = el("tbody");
  const fillIncidents = (list) => incidentRows.replaceChildren(...list.map((i) => el("tr",
    { class: "clickable", onclick: () => showIncident(name, i.seq) },
    el("td", { class: "num" }, num(i.step)), el("td", {}, i.kind), el("td", {}, when(i.time)),
    el("td", i.triage ? { class: "triage " + i.triage.category, title: `${i.triage.evidence}; next: ${i.triage.next_step}` } : {},
      i.triage ? i.triage.category : ""),
    el("td", { style: "white-space: normal" }, i.line))));
  fillIncidents(incidents);
  main.replaceChildren(
    el("div", { class: "toolbar" }, el("h1", {}, run.name), el("a", { href: "#/" }, "← all runs")),
    stats,
    el("div", { class: "grid" }, chartBox("chart-loss", "Loss (▼ incidents: click for evidence)"),
       chartBox("chart-lr", "Learning rate"), chartBox("chart-tps", "Throughput (tokens/s)"),
       chartBox("chart-mfu", "MFU"), chartBox("chart-gnorm", "Gradient norm"),
       chartBox("chart-ranks", "Step time per rank (straggler check windows)")),
    el("div", { class: "section card" }, el("h2", {}, incidentsTitle(incidents)),
       el("table", { id: "incidents" }, el("thead", {}, el("tr", {}, ["step", "kind", "time", "triage", "what"].map((h) =>
         el("th", {}, h)))), incidentRows)),
    layerSection(layers, incidents),
    ...(experts ? [expertSection(name, experts)] : []),
    ...taxSection(evaluations), evalSection(evaluations.filter((e) => e.kind !== "eval_tax")),
    checkpointSection(checkpoints), healthSection(health),
    el("div", { class: "section card" }, el("h2", {}, "Config"), el("details", {}, el("summary", {}, "config.toml"),
       el("pre", {}, run.config || "(none)"))));
  await drawRunCharts(name, run, incidents, evaluations);
  drawRankHeatmap(health);
  drawLayers(layers, incidents, "grad");
  if (experts) drawExperts(experts);
  if (run.status === "running") {
    setLive(true);
    let busy = false;
    const refresh = async () => {
      if (busy) return;
      busy = true;
      try {
        [run, { incidents }, { evaluations }] = await load();
        fillStats(run);
        fillIncidents(incidents);
        await drawRunCharts(name, run, incidents, evaluations);
        if (run.status !== "running") stop();
      } catch (err) { showError(err.message); } finally { busy = false; }
    };
    // The server says when there is something new (server-sent events); the browser reconnects by itself.
    stream = new EventSource(`api/runs/${enc(name)}/stream` + (TOKEN ? `?token=${enc(TOKEN)}` : ""));
    stream.addEventListener("progress", refresh);
  }
}

function table(id, head, rows) {
  return el("table", { id }, el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))), el("tbody", {}, rows));
}

function evalSection(evaluations) {
  const rows = evaluations.map((e) => el("tr", {}, el("td", { class: "num" }, num(e.step)), el("td", {}, e.kind),
    el("td", { class: "num" }, num(e.loss)), el("td", {}, e.task || e.name || ""),
    el("td", { class: "num" }, num(e.accuracy ?? e.score))));
  return el("div", { class: "section card" }, el("h2", {}, `Evaluations (${evaluations.length})`),
    evaluations.length ? table("evaluations", ["step", "kind", "loss", "task", "score"], rows)
      : el("p", { class: "muted" }, "none"));
}

// `liandan eval --against --record`: the newest comparison with the base model, a tax (a drop beyond the
// prompt-format spread, any rise of held-out bits per byte) in red.
function taxSection(evaluations) {
  const tax = evaluations.filter((e) => e.kind === "eval_tax").pop();
  if (!tax) return [];
  const row = (r, name, what, digits) => el("tr", { class: r.verdict === "tax" || r.verdict === "gain" ? r.verdict : "" },
    el("td", {}, name), el("td", {}, what), el("td", { class: "num" }, num(r.before, digits)),
    el("td", { class: "num" }, num(r.after, digits)), el("td", { class: "num" }, (r.change >= 0 ? "+" : "") + num(r.change, digits)),
    el("td", { class: "num" }, r.spread === undefined ? "" : num(r.spread, 3)), el("td", {}, r.verdict || ""));
  const rows = [...(tax.tasks || []).map((r) => row(r, r.task, r.metric, 3)),
                ...(tax.heldout || []).map((r) => row(r, `held-out ${r.source}`, "bits/byte", 4))];
  return [el("div", { class: "section card" }, el("h2", {}, "Before and after fine-tuning"),
    el("p", { class: "muted" }, `base ${tax.baseline} (step ${tax.baseline_step}) → step ${tax.step}`),
    table("before-after", ["task", "metric", "before", "after", "change", "spread", "verdict"], rows),
    ...(tax.notes || []).map((n) => el("p", { class: "muted" }, n)))];
}

// A save's cost to training is the time it blocked the step; an async save's total runs on beside training.
function checkpointSection(checkpoints) {
  const rows = checkpoints.map((c) => el("tr", {}, el("td", { class: "num" }, num(c.step)), el("td", {}, c.kind),
    el("td", {}, c.path || ""), el("td", { class: "num" }, num(c.blocking_seconds, 3)),
    el("td", { class: "num" }, num(c.seconds, 2)), el("td", {}, c.present ? "yes" : "no")));
  return el("div", { class: "section card" }, el("h2", {}, `Checkpoints (${checkpoints.length})`),
    checkpoints.length ? table("checkpoints", ["step", "event", "path", "training blocked (s)", "save took (s)",
                                               "on disk"], rows)
      : el("p", { class: "muted" }, "none"));
}

function healthSection(health) {
  const parts = [el("h2", {}, "Per-rank health")];
  if (health.doctor) {
    parts.push(el("p", {}, health.doctor.summary || ""));
    parts.push(table("doctor", ["rank", "host", "device", "golden products", "memory bandwidth"],
      health.doctor.ranks.map((r) => el("tr", {}, el("td", {}, r.rank), el("td", {}, r.host), el("td", {}, r.device),
        el("td", {}, r.golden_ok ? "ok" : "WRONG"), el("td", { class: "num" }, num(r.memory_bandwidth) + "B/s")))));
  }
  if (health.findings.length) {
    parts.push(table("findings", ["step", "kind", "rank", "host", "what"], health.findings.map((f) => el("tr", {},
      el("td", {}, num(f.step)), el("td", {}, f.kind), el("td", {}, f.rank ?? ""), el("td", {}, f.host ?? ""),
      el("td", { style: "white-space: normal" }, f.phase || f.detail || f.cause || "")))));
  } else parts.push(el("p", { class: "muted" }, "No straggler or silent-data-corruption findings."));
  if (health.heartbeats.length) {
    parts.push(table("heartbeats", ["rank", "host", "step", "phase", "last beat"], health.heartbeats.map((h) =>
      el("tr", {}, el("td", {}, h.rank), el("td", {}, h.host), el("td", {}, num(h.step)), el("td", {}, h.phase),
        el("td", {}, when(h.time))))));
  }
  return el("div", { class: "section card" }, parts);
}

function drawRankHeatmap(health) {
  const windows = health.windows.filter((w) => Array.isArray(w.seconds));
  const box = document.getElementById("chart-ranks");
  if (!windows.length) {
    box.replaceChildren(el("p", { class: "muted" }, "No per-rank times recorded (the straggler check keeps them)."));
    return;
  }
  const byStep = new Map(windows.map((w) => [w.step, w]));  // a resumed run's repeated windows: the newest
  const steps = [...byStep.keys()].sort((a, b) => a - b);
  const ranks = Math.max(...windows.map((w) => w.seconds.length));
  const z = [...Array(ranks).keys()].map((r) => steps.map((s) => {
    const row = byStep.get(s).seconds[r];
    return row ? 1000 * row.reduce((a, b) => a + b, 0) : null;
  }));
  const hosts = windows[windows.length - 1].hosts || [];
  Plotly.react(box, [{ type: "heatmap", x: steps, y: [...Array(ranks).keys()].map((r) => `rank ${r}` +
    (hosts[r] ? ` (${plain(hosts[r])})` : "")), z, colorscale: "YlOrRd", colorbar: { title: { text: "ms/step" } },
    hovertemplate: "%{y}, window ending at step %{x}: %{z:.1f} ms per step<extra></extra>" }],
    layout({ showlegend: false, yaxis: { automargin: true } }), PLOT_CONFIG);
}

const EXPERT_KEY = /^moe\/\d+\/expert\/\d+$/;

// Layers by experts, coloured by load over the layer's mean (1 is balanced; white there, red above, blue below),
// at one logged step chosen on a slider (the newest at first).
function expertSection(name, experts) {
  const label = el("span", { id: "expert-step" }, `step ${num(experts.step)}`);
  const slider = el("input", { type: "range", id: "expert-slider", min: experts.first, max: experts.last,
    value: experts.step, oninput: (e) => { label.textContent = `step ${num(Number(e.target.value))}`; },
    onchange: async (e) => {
      try {
        const shown = await api(`runs/${enc(name)}/experts?step=${enc(e.target.value)}`);
        label.textContent = `step ${num(shown.step)}`;
        drawExperts(shown);
      } catch (err) { showError(err.message); }
    } });
  return el("div", { class: "section card" }, el("h2", {}, "Expert load per MoE layer (load / mean)"),
    el("div", {}, el("label", {}, slider, " ", label)), el("div", { class: "chart", id: "chart-experts" }));
}

function drawExperts(experts) {
  const box = document.getElementById("chart-experts");
  if (!box) return;
  // 0..2 around the balanced 1: a collapsed expert (up to experts/top_k times the mean) is as red as it gets.
  Plotly.react(box, [{ type: "heatmap", x: [...Array(experts.experts).keys()].map((e) => `expert ${e}`),
    y: experts.layers.map((l) => `layer ${l}`), z: experts.load, zmin: 0, zmax: 2,
    colorscale: "RdBu", reversescale: true, colorbar: { title: { text: "load / mean" } },
    hovertemplate: "%{y}, %{x}: %{z:.3f} of the mean load<extra></extra>" }],
    layout({ showlegend: false, xaxis: { title: { text: `experts at step ${experts.step}` } },
             yaxis: { automargin: true, autorange: "reversed" } }), PLOT_CONFIG);
}

function layerSection(layers, incidents) {
  const stats = layers.length ? Object.keys(layers[0]).filter((k) => typeof layers[0][k] === "object" && layers[0][k]) : [];
  const pick = el("select", { id: "layer-stat", onchange: (e) => drawLayers(layers, incidents, e.target.value) },
    stats.map((s) => el("option", { value: s, selected: s === "grad" }, s)));
  return el("div", { class: "section card" }, el("h2", {}, "Per-layer statistics"),
    layers.length ? el("div", {}, el("label", {}, "statistic ", pick), el("div", { class: "chart", id: "chart-layers" }))
      : el("p", { class: "muted" }, "None recorded (the loss-spike guard keeps them every guard.stats_every steps)."));
}

function drawLayers(layers, incidents, stat) {
  if (!layers.length || !document.getElementById("chart-layers")) return;
  const names = [...new Set(layers.flatMap((r) => Object.keys(r[stat] || {})))];
  const traces = names.map((n, i) => ({ name: plain(n), x: layers.map((r) => r.step), y: layers.map((r) => (r[stat] || {})[n]),
    mode: "lines+markers", type: "scatter", line: { color: COLORS[i % COLORS.length] } }));
  Plotly.react("chart-layers", traces, layout({ shapes: incidentShapes(incidents), yaxis: { title: { text: stat },
    ...LOG_AXIS } }), PLOT_CONFIG);
}

// -- an incident's evidence ------------------------------------------------------------------------------
function closeEvidence() { document.getElementById("evidence").hidden = true; }

function keyValues(obj) {
  const grid = el("div", { class: "kv" });
  for (const [k, v] of Object.entries(obj)) {
    if (v === null || typeof v === "object") continue;
    const shown = k === "time" ? when(v) : typeof v === "number" ? num(v) : String(v);
    grid.append(el("div", {}, k), el("div", {}, shown));
  }
  return grid;
}

async function showIncident(name, seq) {
  const panel = document.getElementById("evidence");
  const body = document.getElementById("evidence-body");
  body.replaceChildren(el("p", { class: "muted" }, "Loading…"));
  panel.hidden = false;
  try {
    const { event, evidence, layers } = await api(`runs/${enc(name)}/incidents/${seq}`);
    document.getElementById("evidence-title").textContent = `${event.kind} at step ${event.step ?? "?"}`;
    const parts = [];
    if (event.triage) parts.push(el("div", { class: "triage-verdict " + event.triage.category },
      `${event.triage.category}: ${event.triage.evidence}. Next: ${event.triage.next_step}`));
    parts.push(keyValues(event));
    if (event.evidence) parts.push(el("details", {}, el("summary", {}, "the supervisor's evidence"),
      el("pre", {}, JSON.stringify(event.evidence, null, 2))));
    for (const item of evidence) {
      parts.push(el("h2", {}, `${item.what}: ${item.file}`));
      if (item.json) {
        if (item.json.verdict) parts.push(el("div", { class: "verdict" }, item.json.verdict));
        if (Array.isArray(item.json.documents) && item.json.documents.length) {
          parts.push(el("p", {}, `${item.json.documents.length} document(s) named:`),
            table("documents", ["data step", "source", "id", "store", "document"], item.json.documents.slice(0, 50)
              .map((d) => el("tr", {}, el("td", {}, d.data_step), el("td", {}, d.source ?? ""), el("td", {}, d.id ?? ""),
                el("td", {}, d.store ?? ""), el("td", {}, d.document ?? "")))));
        }
        parts.push(el("details", {}, el("summary", {}, "whole report"), el("pre", {}, JSON.stringify(item.json, null, 2))));
      } else {
        parts.push(el("pre", { class: "evidence-text" }, (item.truncated ? "…\n" : "") + item.text));
      }
    }
    if (!evidence.length) parts.push(el("p", { class: "muted" }, "No files point to this incident."));
    if (layers.length) {
      parts.push(el("h2", {}, "Layer gradient norms around it"), el("div", { class: "chart", id: "chart-evidence-layers" }));
    }
    body.replaceChildren(...parts);
    if (layers.length) {
      const names = [...new Set(layers.flatMap((r) => Object.keys(r.grad || {})))];
      Plotly.react("chart-evidence-layers", names.map((n, i) => ({ name: plain(n), x: layers.map((r) => r.step),
        y: layers.map((r) => (r.grad || {})[n]), type: "scatter", mode: "lines+markers",
        line: { color: COLORS[i % COLORS.length] } })), layout({ yaxis: { ...LOG_AXIS },
        shapes: event.step !== undefined ? incidentShapes([event]) : [] }), PLOT_CONFIG);
    }
  } catch (err) {
    body.replaceChildren(el("p", {}, "Could not load the evidence: " + err.message));
  }
}

// -- comparing runs --------------------------------------------------------------------------------------
function smooth(ys, weight) {
  if (!weight) return ys;
  let last = 0, count = 0;
  return ys.map((y) => {
    if (y === null) return null;
    last = last * weight + (1 - weight) * y;
    count += 1;
    return last / (1 - Math.pow(weight, count));  // the first points are not pulled towards zero
  });
}

async function compareView(main, params) {
  const { runs } = await api("runs");
  const chosen = new Set((params.get("runs") || "").split(",").filter(Boolean));
  if (!chosen.size) runs.slice(0, 2).forEach((r) => chosen.add(r.name));
  const state = { key: params.get("key") || "loss", x: params.get("x") || "step", logx: false, logy: false, smooth: 0 };
  const boxes = runs.map((r) => el("label", {}, el("input", { type: "checkbox", checked: chosen.has(r.name),
    onchange: (e) => { e.target.checked ? chosen.add(r.name) : chosen.delete(r.name); draw(); } }), r.name));
  const keySelect = el("select", { id: "compare-key", onchange: (e) => { state.key = e.target.value; draw(); } },
    ["loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s"].map((k) => el("option", { value: k, selected: k === state.key }, k)));
  const xSelect = el("select", { id: "compare-x", onchange: (e) => { state.x = e.target.value; draw(); } },
    ["step", "tokens", "flops", "time"].map((k) => el("option", { value: k, selected: k === state.x }, k)));
  const slider = el("input", { type: "range", id: "compare-smooth", min: 0, max: 0.99, step: 0.01, value: 0,
    oninput: (e) => { state.smooth = Number(e.target.value); sliderValue.textContent = state.smooth.toFixed(2); redraw(); } });
  const sliderValue = el("span", {}, "0.00");
  const toggle = (id, field, label) => el("label", {}, el("input", { type: "checkbox", id,
    onchange: (e) => { state[field] = e.target.checked; redraw(); } }), label);
  const note = el("p", { class: "muted", id: "compare-note" });
  main.replaceChildren(el("h1", {}, "Compare runs"), el("div", { class: "toolbar" }, boxes),
    el("div", { class: "toolbar" }, el("label", {}, "metric ", keySelect), el("label", {}, "x ", xSelect),
      toggle("compare-logx", "logx", "log x"), toggle("compare-logy", "logy", "log y"),
      el("label", {}, "smoothing ", slider, sliderValue)),
    el("div", { class: "card" }, el("div", { class: "chart", id: "chart-compare", style: "height: 480px" })), note);
  let data = null;
  function redraw() {
    if (!data) return;
    const traces = [];
    data.curves.forEach((c, i) => {
      if (c.missing) return;
      const color = COLORS[i % COLORS.length];
      if (state.smooth) traces.push({ x: c.x, y: c.y, type: "scatter", mode: "lines", showlegend: false,
        hoverinfo: "skip", line: { color, width: 1 }, opacity: 0.25 });
      traces.push({ name: plain(c.run), x: c.x, y: smooth(c.y, state.smooth), type: "scatter", mode: "lines",
        line: { color, width: 2 } });
    });
    Plotly.react("chart-compare", traces, layout({ xaxis: { title: { text: data.x_axis }, type: state.logx ? "log" : "linear" },
      yaxis: { title: { text: data.key }, type: state.logy ? "log" : "linear" } }), PLOT_CONFIG);
    const missing = data.curves.filter((c) => c.missing).map((c) => `${c.run} (${c.missing})`);
    note.textContent = missing.length ? `Not shown: ${missing.join("; ")}` : "";
  }
  async function draw() {
    history.replaceState(null, "", `${location.search}#/compare?runs=${[...chosen].map(enc).join(",")}` +
      `&key=${enc(state.key)}&x=${enc(state.x)}`);
    if (!chosen.size) { data = null; Plotly.purge("chart-compare"); return; }
    try {
      data = await api("compare", { method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ runs: [...chosen], key: state.key, x: state.x, max_points: 4000 }) });
      redraw();
    } catch (err) { showError(err.message); }
  }
  await draw();
}

document.getElementById("evidence-close").addEventListener("click", closeEvidence);
window.addEventListener("hashchange", route);
route();
