// The tx web console: plain JS, no framework, no build step. It calls the server's JSON API with the API key
// the user signed in with (kept in sessionStorage: this tab only) as X-API-Key, so it shows exactly what that
// key may read. Every value from the server reaches the page as text (textContent), never as HTML.
"use strict";

const KEY = "tx-console-api-key";
const SVG = "http://www.w3.org/2000/svg";
const state = { admin: false, session: null, run: null, history: null };

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

class ApiError extends Error {
  constructor(status, detail) { super(`${status}: ${detail}`); this.status = status; }
}

async function api(path, options = {}) {
  const headers = { "X-API-Key": sessionStorage.getItem(KEY) || "", ...(options.headers || {}) };
  const r = await fetch(path, { ...options, headers });
  if (!r.ok) {
    let detail = r.statusText;
    try { detail = (await r.json()).detail || detail; } catch (_) { /* not JSON */ }
    if (r.status === 401) signOut(`signed out: ${detail}`);
    throw new ApiError(r.status, detail);
  }
  return r;
}
const json = async (path, options) => (await api(path, options)).json();

function fmtTime(iso) { return iso ? new Date(iso).toLocaleString() : ""; }
function fmtNum(x, digits = 3) {
  if (x === null || x === undefined) return "";
  if (typeof x !== "number") return String(x);
  return Math.abs(x) >= 1e5 || (x !== 0 && Math.abs(x) < 1e-3) ? x.toExponential(2) : String(+x.toFixed(digits));
}
function fmtBytes(b) {
  if (b === null || b === undefined) return "n/a";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(i ? 1 : 0)} ${units[i]}`;
}
function fill(tbody, rows) { tbody.replaceChildren(...rows); }
function kv(table, entries) {
  fill(table.tBodies[0], entries.map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { class: "num", text: fmtNum(v) }))));
}

// ---- charts: inline SVG, one path per series ----

const W = 460, H = 180, PAD = { l: 56, r: 10, t: 24, b: 28 };

function chart(title, series, { xLabel = "", time = false, id = null, wide = false } = {}) {
  const width = wide ? 920 : W;
  const svg = el("svg:svg", { viewBox: `0 0 ${width} ${H}`, class: "chart-svg", role: "img", "aria-label": title, id });
  svg.append(el("svg:text", { x: PAD.l, y: 14, class: "chart-title", text: title }));
  const xs = series.flatMap((s) => s.xs), ys = series.flatMap((s) => s.ys).filter((y) => y !== null && isFinite(y));
  if (!xs.length || !ys.length) {
    svg.append(el("svg:text", { x: width / 2, y: H / 2, class: "chart-empty", "text-anchor": "middle", text: "no data yet" }));
    return svg;
  }
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(0, ...ys), Math.max(...ys)];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y1 = y0 + 1; }
  const sx = (x) => PAD.l + ((x - x0) / (x1 - x0)) * (width - PAD.l - PAD.r);
  const sy = (y) => H - PAD.b - ((y - y0) / (y1 - y0)) * (H - PAD.t - PAD.b);
  // axes and labels
  svg.append(el("svg:line", { x1: PAD.l, y1: H - PAD.b, x2: width - PAD.r, y2: H - PAD.b, class: "axis" }));
  svg.append(el("svg:line", { x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: H - PAD.b, class: "axis" }));
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    svg.append(el("svg:line", { x1: PAD.l, y1: sy(y), x2: width - PAD.r, y2: sy(y), class: "grid" }));
    svg.append(el("svg:text", { x: PAD.l - 4, y: sy(y) + 4, "text-anchor": "end", class: "tick", text: fmtNum(y) }));
  }
  const xt = (x) => (time ? new Date(x * 1000).toLocaleTimeString() : fmtNum(x));
  svg.append(el("svg:text", { x: PAD.l, y: H - 8, class: "tick", text: xt(x0) }));
  svg.append(el("svg:text", { x: width - PAD.r, y: H - 8, "text-anchor": "end", class: "tick", text: `${xt(x1)} ${xLabel}` }));
  series.forEach((s, i) => {
    const pts = s.xs.map((x, j) => [x, s.ys[j]]).filter(([, y]) => y !== null && isFinite(y));
    const d = pts.map(([x, y], j) => `${j ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
    svg.append(el("svg:path", { d, class: `series s${i}`, "data-series": s.name, "data-points": pts.length }));
    if (s.dots) for (const [x, y] of pts) {
      const dot = el("svg:circle", { cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 2.5, class: `point s${i}` });
      dot.append(el("svg:title", { text: `${fmtNum(x)}: ${fmtNum(y, 5)}` }));
      svg.append(dot);
    }
    if (series.length > 1) {
      svg.append(el("svg:text", { x: width - PAD.r - 150, y: PAD.t + 12 * i + 4, class: `legend s${i}`, text: s.name }));
    }
  });
  return svg;
}

function seriesCharts(container, stats) {
  const t = stats.t, s = stats.series;
  const line = (name, key) => ({ name, xs: t, ys: s[key] });
  container.replaceChildren(
    chart("requests", [line("active sample requests", "active_sample_requests"), line("queued requests", "queued_requests")], { time: true }),
    chart("training utilization", [line("training utilization", "training_utilization")], { time: true }),
    chart("tokens / s", [line("training", "training_tokens_per_s"), line("sampling", "sampling_tokens_per_s"),
                         line("prefill", "prefill_tokens_per_s")], { time: true }),
  );
}

function latencyRows(stats) {
  const kinds = [...new Set([...Object.keys(stats.requests || {}), ...Object.keys(stats.latency_s || {})])].sort();
  return kinds.map((kind) => {
    const n = (stats.requests || {})[kind] || {}, l = (stats.latency_s || {})[kind] || {};
    return el("tr", { "data-kind": kind }, el("td", { text: kind }),
      ...[n.done, n.failed, n.pending, l.p50, l.p90, l.p99, l.queue_p50].map((v) => el("td", { class: "num", text: fmtNum(v) })));
  });
}

// ---- sign in / out ----

async function signIn(key) {
  sessionStorage.setItem(KEY, key);
  try {
    const me = await json("/api/v1/console/whoami");
    state.admin = me.admin;
    $("whoami").textContent = `${me.admin ? "admin" : "tenant"} ${me.tenant}`;
  } catch (e) {
    sessionStorage.removeItem(KEY);
    $("signin-error").textContent = e.status === 401 ? "unknown API key" : e.message;
    return;
  }
  $("signin-error").textContent = "";
  document.body.classList.toggle("admin", state.admin);
  $("nav").hidden = false;
  $("nav-admin").hidden = !state.admin;
  show("work-view");
}

function signOut(message = "") {
  sessionStorage.removeItem(KEY);
  Object.assign(state, { admin: false, session: null, run: null, history: null });
  $("whoami").textContent = "";
  $("nav").hidden = true;
  $("signin-error").textContent = message;
  $("session-detail").hidden = $("run-detail").hidden = true;
  for (const id of ["sessions-table", "runs-table", "checkpoints-table", "latency-table"]) fill($(id).tBodies[0], []);
  show("signin-view");
}

function show(view) {
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== view;
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.view === view);
  if (view === "work-view") loadWork().catch((e) => { $("work-error").textContent = e.message; });
  if (view === "admin-view") loadAdmin().catch((e) => { $("admin-error").textContent = e.message; });
}

// ---- sessions and runs ----

async function loadWork() {
  $("work-error").textContent = "";
  const [sessions, runs] = await Promise.all([json("/api/v1/console/sessions?limit=200"),
                                              json("/api/v1/training_runs?limit=1000")]);
  fill($("sessions-table").tBodies[0], sessions.sessions.map((s) => el("tr",
    { "data-session-id": s.session_id, class: s.session_id === state.session ? "selected" : null, onclick: () => openSession(s.session_id) },
    el("td", { class: "tenant-col", text: s.tenant || "" }), el("td", {}, el("code", { text: s.session_id })),
    el("td", { text: s.status }), el("td", { text: fmtTime(s.created_at) }), el("td", { text: fmtTime(s.last_heartbeat) }),
    el("td", { class: "num", text: s.training_run_ids.length }), el("td", { class: "num", text: s.sampler_ids.length }))));
  fill($("runs-table").tBodies[0], runs.training_runs.map((r) => el("tr",
    { "data-run-id": r.training_run_id, class: r.training_run_id === state.run ? "selected" : null, onclick: () => openRun(r.training_run_id) },
    el("td", {}, el("code", { text: r.training_run_id })), el("td", { text: r.base_model }), el("td", { class: "num", text: r.lora_rank ?? "" }),
    el("td", {}, el("code", { text: r.model_owner })), el("td", { text: fmtTime(r.last_request_time) }),
    el("td", { text: r.last_checkpoint ? r.last_checkpoint.checkpoint_id : "" }))));
  if (state.session) await openSession(state.session);
  if (state.run) await openRun(state.run);
}

function select(tableId, attr, id) {
  for (const tr of $(tableId).tBodies[0].rows) tr.classList.toggle("selected", tr.getAttribute(attr) === id);
}

async function openSession(id) {
  state.session = id;
  select("sessions-table", "data-session-id", id);
  $("session-detail").hidden = false;
  $("session-title").textContent = id;
  $("trace-download").dataset.url = `/api/v1/sessions/${encodeURIComponent(id)}/trace`;
  const stats = await json(`/api/v1/sessions/${encodeURIComponent(id)}/stats?window_s=${$("stats-window").value}`);
  seriesCharts($("session-charts"), stats);
  fill($("latency-table").tBodies[0], latencyRows(stats));
}

async function downloadTrace() {
  const url = $("trace-download").dataset.url;
  if (!url) return;
  const r = await api(url);
  const name = /filename="([^"]+)"/.exec(r.headers.get("content-disposition") || "")?.[1] || "tx.trace.json";
  const href = URL.createObjectURL(await r.blob());
  const a = el("a", { href, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(href), 60000);
}

const METRICS = { loss_sum: "loss:sum", loss_per_token: "loss per token", tokens: "tokens" };

async function openRun(id) {
  state.run = id;
  select("runs-table", "data-run-id", id);
  $("run-detail").hidden = false;
  $("run-title").textContent = id;
  const enc = encodeURIComponent(id);
  const [history, checkpoints] = await Promise.all([json(`/api/v1/training_runs/${enc}/loss_history`),
                                                    json(`/api/v1/training_runs/${enc}/checkpoints`)]);
  state.history = history;
  const names = { ...METRICS };
  for (const s of history.steps) for (const k of Object.keys(s.metrics)) names[`m:${k}`] = k;
  const picked = $("run-metric").value || "loss_sum";
  $("run-metric").replaceChildren(...Object.entries(names).map(([k, label]) => el("option", { value: k, text: label })));
  $("run-metric").value = names[picked] ? picked : "loss_sum";
  drawRun();
  fill($("checkpoints-table").tBodies[0], checkpoints.checkpoints.map((c) => checkpointRow(id, c)));
}

function drawRun() {
  const h = state.history, key = $("run-metric").value || "loss_sum";
  const value = (s) => (key.startsWith("m:") ? s.metrics[key.slice(2)] : s[key]) ?? null;
  const steps = h ? h.steps : [];
  const svg = chart(`${$("run-metric").selectedOptions[0]?.textContent || key} by step`,
    [{ name: key, xs: steps.map((s) => s.step), ys: steps.map(value), dots: true }], { xLabel: "step", wide: true, id: "loss-svg" });
  $("loss-chart").replaceChildren(svg);
  const last = steps[steps.length - 1];
  $("run-summary").textContent = last ? `${steps.length} steps; last: ${fmtNum(value(last), 5)}` +
    (h.pending ? `; ${h.pending.passes} forward_backward since` : "") : "no optim_step yet";
}

function checkpointRow(runId, c) {
  const [kind, ...rest] = c.checkpoint_id.split("/");
  const base = `/api/v1/training_runs/${encodeURIComponent(runId)}/checkpoints/${encodeURIComponent(kind)}/${encodeURIComponent(rest.join("/"))}`;
  const act = (label, method, path, confirmText) => el("button", {
    class: `ckpt-${label}`, text: label, onclick: async (ev) => {
      ev.stopPropagation();
      if (confirmText && !window.confirm(confirmText)) return;
      try { await api(base + path, { method }); } catch (e) { $("work-error").textContent = e.message; }
      await openRun(runId);
    },
  });
  return el("tr", { "data-checkpoint-id": c.checkpoint_id, "data-public": c.public ? "true" : "false" },
    el("td", { text: c.checkpoint_id }), el("td", { text: c.checkpoint_type }), el("td", { text: fmtTime(c.time) }),
    el("td", { class: "num", text: fmtBytes(c.size_bytes) }), el("td", { text: c.public ? "yes" : "no" }),
    el("td", {}, el("code", { text: c.tinker_path })),
    el("td", {}, c.public ? act("unpublish", "DELETE", "/publish") : act("publish", "POST", "/publish"),
      act("delete", "DELETE", "", `Delete ${c.tinker_path}? This cannot be undone.`)));
}

// ---- admin ----

async function loadAdmin() {
  $("admin-error").textContent = "";
  const [m, stats] = await Promise.all([json("/api/v1/metrics"), json("/api/v1/stats?window_s=900")]);
  const e = m.engine || {}, s = m.backend_sampling || {};
  const sum = (o) => Object.values(o || {}).reduce((a, b) => a + (typeof b === "number" ? b : 0), 0);
  const cached = s.prefill_tokens_cached || 0, computed = s.prefill_tokens || 0;
  const cards = [
    ["rounds", e.rounds || 0],
    ["backend calls", sum(m.backend_calls)],
    ["compiles", sum(m.backend_compiles)],
    ["KV pages in use", s.kv_cache_pages !== undefined ? `${s.pages_in_use || 0} / ${s.kv_cache_pages}` : "n/a"],
    ["KV peak pages", s.peak_pages ?? "n/a"],
    ["prefix-cache hit rate", cached + computed ? `${((100 * cached) / (cached + computed)).toFixed(1)} %` : "n/a"],
    ["compile cache hits / misses", `${(m.compile_cache || {}).hits ?? 0} / ${(m.compile_cache || {}).misses ?? 0}`],
    ["cross-tenant forward_backward", e.cross_tenant_forward_backward_calls || 0],
  ];
  $("admin-cards").replaceChildren(...cards.map(([k, v]) => el("div", { class: "card", "data-card": k },
    el("div", { class: "card-value", text: typeof v === "number" ? fmtNum(v) : v }), el("div", { class: "card-label", text: k }))));
  seriesCharts($("admin-charts"), stats);
  kv($("admin-calls"), Object.entries(m.backend_calls || {}).sort());
  const byBase = [];
  for (const [base, calls] of Object.entries(m.backend_calls_by_base_model || {})) {
    for (const [kind, n] of Object.entries(calls)) byBase.push([`${base}: ${kind}`, n]);
  }
  kv($("admin-calls-by-base"), byBase.sort());
  kv($("admin-compiles"), Object.entries(m.backend_compiles || {}).sort());
  fill($("admin-memory").tBodies[0], (m.device_memory || []).map((d) => el("tr", {},
    el("td", { text: d.device }), el("td", { class: "num", text: `${fmtBytes(d.bytes_in_use)} in use` }),
    el("td", { class: "num", text: `${fmtBytes(d.peak_bytes_in_use)} peak` }), el("td", { class: "num", text: `${fmtBytes(d.bytes_limit)} limit` }))));
  kv($("admin-engine"), Object.entries(e).sort());
}

// ---- wiring ----

document.addEventListener("DOMContentLoaded", () => {
  $("signin-form").addEventListener("submit", (ev) => { ev.preventDefault(); signIn($("api-key").value.trim()); $("api-key").value = ""; });
  $("signout").addEventListener("click", () => signOut());
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => show(b.dataset.view));
  $("stats-refresh").addEventListener("click", () => state.session && openSession(state.session));
  $("stats-window").addEventListener("change", () => state.session && openSession(state.session));
  $("trace-download").addEventListener("click", () => downloadTrace().catch((e) => { $("work-error").textContent = e.message; }));
  $("run-metric").addEventListener("change", drawRun);
  $("admin-refresh").addEventListener("click", () => loadAdmin().catch((e) => { $("admin-error").textContent = e.message; }));
  const key = sessionStorage.getItem(KEY);
  if (key) signIn(key); else show("signin-view");
});
