// The KCoral dashboard: polls the service's JSON (same origin only, as the
// page's Content-Security-Policy allows) and renders it with DOM calls;
// report text reaches the page through textContent, never as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const TOKEN_KEY = "kcoral-client-token";
// The plots span at least this much, so a young history is not stretched.
const MIN_SPAN_SECONDS = 60;

const PLOTS = [
  {title: "Runs / s", series: [["rate", "runs/s", 1]], floor: 1, digits: 1},
  {title: "Latency (ms)", series: [["p50", "p50", 1000], ["p99", "p99", 1000]], floor: 1, digits: 1},
  {title: "Queue depth", series: [["queued", "waiting", 1], ["active", "running", 1]], floor: 1, digits: 0},
  {title: "Cache hits (%)", series: [["cache_hit_ratio", "hits", 100]], fixed: 100, digits: 0},
];

function element(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attributes) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  return node;
}

function formatNumber(value, digits) {
  return value === null || value === undefined ? "–" : value.toFixed(digits);
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 10 ? value.toFixed(1) + " s" : Math.round(value) + " s";
}

async function getJSON(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? {Authorization: "Bearer " + token} : {};
  const response = await fetch(path, {headers, cache: "no-store"});
  return {status: response.status, body: await response.json()};
}

// -- plots ---------------------------------------------------------------------------------

function sparkline(samples, plot) {
  const width = 300, height = 70;
  const chart = svg("svg", {viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none",
                             role: "img", "aria-label": plot.title});
  const newest = samples.length ? samples[samples.length - 1].time : 0;
  const span = Math.max(MIN_SPAN_SECONDS, samples.length ? newest - samples[0].time : 0);
  let top = plot.fixed;
  if (top === undefined) {
    top = plot.floor;
    for (const [field, , scale] of plot.series) {
      for (const s of samples) if (s[field] !== null) top = Math.max(top, s[field] * scale * 1.1);
    }
  }
  for (const fraction of [0.5, 1]) {
    const y = height - fraction * height;
    chart.append(svg("line", {x1: 0, x2: width, y1: y, y2: y, class: "grid"}));
  }
  let drawn = false;
  plot.series.forEach(([field, , scale], index) => {
    // A run of samples without a value (no runs: no latency) breaks the line.
    let path = "", pen = "M";
    for (const s of samples) {
      if (s[field] === null) { pen = "M"; continue; }
      const x = width - (newest - s.time) / span * width;
      const y = height - (s[field] * scale) / top * (height - 2) - 1;
      path += `${pen}${x.toFixed(1)},${y.toFixed(1)} `;
      pen = "L";
    }
    if (path) chart.append(svg("path", {d: path, class: `line line${index}`}));
    drawn = drawn || Boolean(path);
  });
  return {chart: drawn ? chart : element("div", {class: "nodata"}, "no data yet"), top, span};
}

function renderPlots(history) {
  const samples = history.samples;
  const last = samples.length ? samples[samples.length - 1] : {};
  const section = document.getElementById("plots");
  section.replaceChildren(...PLOTS.map((plot) => {
    const {chart, top, span} = sparkline(samples, plot);
    const legend = element("div", {class: "legend"}, ...plot.series.map(([field, label, scale], i) =>
      element("span", {class: `key key${i}`},
              `${label} ${last[field] === null || last[field] === undefined
                ? "–" : formatNumber(last[field] * scale, plot.digits)}`)));
    const axis = element("div", {class: "axis"},
                         element("span", {}, `−${Math.round(span / 60)} min`),
                         element("span", {}, `max ${formatNumber(top, plot.digits)}`),
                         element("span", {}, "now"));
    return element("figure", {class: "plot", "data-plot": plot.series[0][0]},
                   element("figcaption", {}, plot.title), legend, chart, axis);
  }));
}

// -- summary -------------------------------------------------------------------------------

function renderHealth(health) {
  document.getElementById("service").textContent = health.workers ? "gateway" : "router";
  const status = document.getElementById("status");
  status.textContent = health.status;
  status.className = `badge state-${health.status}`;
  const nodes = Object.entries(health.nodes || {}).filter(([, n]) => n)
    .map(([state, n]) => `${n} ${state}`).join(", ") || "none";
  const facts = [["Target", health.gpu_target || "–"], ["Capacity", health.capacity],
                 ["Active", health.active], ["Queued", health.queued], ["Nodes", nodes],
                 ["Version", health.version]];
  document.getElementById("summary").replaceChildren(...facts.flatMap(([name, value]) =>
    [element("dt", {}, name), element("dd", {}, String(value))]));
}

// -- nodes ---------------------------------------------------------------------------------

function sum(values) {
  const known = values.filter((v) => typeof v === "number");
  return known.length ? known.reduce((a, b) => a + b, 0) : undefined;
}

function renderNodes(nodes) {
  const workers = nodes.flatMap((n) => n.workers || []);
  // Fields that some services report and others do not get a column only where present.
  const devices = workers.some((w) => "devices" in w);
  const restarts = workers.some((w) => "restarts" in w);
  const numbers = [...(devices ? ["Devices"] : []), "Capacity", "Active", "Last report",
                   ...(restarts ? ["Restarts"] : [])];
  const table = document.getElementById("nodes");
  table.tHead.rows[0].replaceChildren(
    ...["Node / worker", "State", "Target", "Address / reason"].map((c) => element("th", {}, c)),
    ...numbers.map((c) => element("th", {class: "number"}, c)));
  const cell = (text, cls) => element("td", cls ? {class: cls} : {}, String(text ?? "–"));
  const optional = (row, value) => row.concat(value === null ? [] : [value]);
  const rows = [];
  for (const node of nodes) {
    const members = node.workers || [];
    let row = [cell(node.node_id, "name"),
               element("td", {}, element("span", {class: `badge state-${node.state}`}, node.state)),
               // A ready node's reason only says how it became ready.
               cell(node.gpu_target), cell(node.state === "ready" ? "" : node.reason || "", "reason")];
    row = optional(row, devices ? cell(sum(members.map((w) => w.devices)), "number") : null);
    row.push(cell(node.capacity, "number"), cell(node.active, "number"),
             cell(seconds(node.last_report_age_seconds), "number"));
    row = optional(row, restarts ? cell(sum(members.map((w) => w.restarts)), "number") : null);
    rows.push(element("tr", {class: "node", "data-node": node.node_id, "data-state": node.state},
                      ...row));
    for (const worker of members) {
      const health = worker.healthy ? "healthy" : "unhealthy";
      let sub = [cell(worker.name, "name worker"),
                 element("td", {}, element("span", {class: `badge state-${health}`}, health)),
                 cell(""), cell(worker.url, "address")];
      sub = optional(sub, devices ? cell(worker.devices, "number") : null);
      sub.push(cell(worker.capacity, "number"), cell(worker.active, "number"), cell(""));
      sub = optional(sub, restarts ? cell(worker.restarts, "number") : null);
      rows.push(element("tr", {class: "worker", "data-worker": worker.name, "data-state": health},
                        ...sub));
    }
  }
  table.tBodies[0].replaceChildren(...rows);
  document.getElementById("empty").hidden = nodes.length > 0;
}

// -- the loop ------------------------------------------------------------------------------

// One round: every part of the page from the service's answers; the
// history's sampling interval, which is also the pace of the next round.
async function refresh() {
  let interval = 2;
  try {
    const dashboard = await getJSON("v1/dashboard");
    interval = dashboard.body.history.interval_seconds;
    renderHealth(dashboard.body.health);
    renderPlots(dashboard.body.history);
    const nodes = await getJSON("v1/nodes");
    document.getElementById("token-form").hidden = nodes.status !== 401;
    if (nodes.status === 200) renderNodes(nodes.body.nodes);
    document.getElementById("updated").textContent =
      "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "yes";
  } catch (error) {
    document.getElementById("updated").textContent = "unreachable: " + error.message;
    document.body.dataset.loaded = "error";
  }
  return interval;
}

async function loop() {
  setTimeout(loop, (await refresh()) * 1000);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
    refresh();
  });
  loop();
});
