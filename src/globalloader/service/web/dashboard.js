// The globalloader dashboard: polls /api/status (same origin; the token travels as a cookie)
// and draws each series on a canvas. No chart library: a few lines of canvas code suffice.
"use strict";

const COLORS = ["#3b6fb6", "#c0504d", "#9bbb59", "#8064a2", "#f79646", "#4bacc6", "#7f7f7f", "#d4a017"];
const POLL_MS = 2000;  // the dashboard polls the server every second: at most 3 s behind

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (cls) node.className = cls;
  return node;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

function pct(x) {
  return (100 * x).toFixed(0) + "%";
}

function mib(n) {
  return (n / 1048576).toFixed(0) + " MiB";
}

// One chart: `series` is [{name, values: [[t, v or null], ...]}]; a null breaks the line.
function drawChart(canvas, series, span, now, fixedMax) {
  const ratio = globalThis.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  const left = 48, right = 8, top = 8, bottom = 36;
  let max = fixedMax || 0;
  for (const s of series) for (const [, v] of s.values) if (v !== null && v > max) max = v;
  if (!max) max = 1;
  ctx.font = "11px system-ui, sans-serif";
  ctx.strokeStyle = "#ddd";
  ctx.fillStyle = "#555";
  for (let k = 0; k <= 2; k++) {
    const y = top + (height - top - bottom) * (1 - k / 2);
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(width - right, y); ctx.stroke();
    const label = max * k / 2;
    ctx.fillText(label >= 100 ? label.toFixed(0) : label.toPrecision(2), 4, y + 4);
  }
  ctx.fillText("-" + Math.round(span / 60) + " min", left, height - bottom + 14);
  ctx.fillText("now", width - right - 22, height - bottom + 14);
  const x = (t) => left + (width - left - right) * (1 - (now - t) / span);
  const y = (v) => top + (height - top - bottom) * (1 - v / max);
  let legendX = left;
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    for (const [t, v] of s.values) {
      if (v === null || t < now - span) { pen = false; continue; }
      if (pen) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      pen = true;
    }
    ctx.stroke();
    ctx.fillStyle = color;
    ctx.fillRect(legendX, height - 14, 10, 10);
    ctx.fillStyle = "#333";
    ctx.fillText(s.name, legendX + 14, height - 5);
    legendX += 24 + ctx.measureText(s.name).width;
  });
}

// Each chart: a title, an optional fixed maximum, and how to read its series from the points.
function chartSpecs(points) {
  const jobs = [];
  for (const p of points) for (const key of Object.keys(p.jobs)) if (!jobs.includes(key)) jobs.push(key);
  const perJob = (k, scale) => jobs.map((key) => ({
    name: key, values: points.map((p) => [p.t, key in p.jobs ? p.jobs[key][k] * scale : null]),
  }));
  const one = (name, field, scale) => ({
    name, values: points.map((p) => [p.t, p[field] === undefined || p[field] === null ? null : p[field] * scale]),
  });
  const specs = [
    {id: "samples", title: "samples/s per job", series: perJob(0, 1)},
    {id: "waiting", title: "training loop waiting for data (% of its time)", max: 100, series: perJob(1, 100)},
    {id: "followed", title: "followed (% of a job's samples another job loaded first)", max: 100, series: perJob(2, 100)},
    {id: "pool", title: "memory pool occupancy (%)", max: 100, series: [one("used", "pool_used", 100)]},
    {id: "hits", title: "pool hits and evictions per s", series: [one("hits", "hits", 1), one("evictions", "evictions", 1)]},
    {id: "saved", title: "decodes saved per s (served without a decode of their own)", series: [one("saved", "saved", 1)]},
    {id: "decoders", title: "decode workers busy (%)", max: 100, series: [one("busy", "decoders_busy", 100)]},
  ];
  if (points.some((p) => "cache_downloaded" in p)) {
    specs.push({id: "cache", title: "object-storage cache: MiB/s downloaded, hits/s",
      series: [one("MiB/s", "cache_downloaded", 1 / 1048576), one("hits/s", "cache_hits", 1)]});
  }
  return specs;
}

function renderCharts(data) {
  const container = document.getElementById("charts");
  const span = Math.max(60, (data.points.length || 1) * data.interval);
  for (const spec of chartSpecs(data.points)) {
    let figure = document.getElementById("chart-" + spec.id);
    if (!figure) {
      figure = el("figure");
      figure.id = "chart-" + spec.id;
      figure.append(el("figcaption", spec.title), el("canvas"));
      container.append(figure);
    }
    drawChart(figure.querySelector("canvas"), spec.series, span, data.now, spec.max);
  }
}

function renderJobs(status) {
  const body = document.querySelector("#jobs tbody");
  const rows = [];
  for (const [jobs, cls] of [[status.jobs, ""], [status.finished || [], "left"]]) {
    for (const j of jobs) {
      const tr = el("tr", undefined, cls);
      tr.dataset.job = j.name;
      const progress = j.size ? pct(j.consumed / j.size) : "";
      for (const cell of [j.name, j.pid, j.state, j.epoch, j.consumed.toLocaleString() + " (" + progress + ")",
        j.samples_per_s.toFixed(0), pct(j.wait_share || 0), pct(j.followed_share)]) {
        tr.append(el("td", String(cell)));
      }
      rows.push(tr);
    }
  }
  body.replaceChildren(...rows);
  const pool = status.pool;
  let text = `pool ${mib(pool.used)} / ${mib(pool.capacity)}, ${pool.samples.toLocaleString()} samples, ` +
    `hits ${(pool.hits || 0).toLocaleString()}, evictions ${(pool.evictions || 0).toLocaleString()}; ` +
    `decodes saved ${status.decodes_saved.toLocaleString()} of ${status.requests.toLocaleString()} requests; ` +
    `${status.workers} decode workers, ${status.worker_restarts} restarted`;
  if (status.cache && typeof status.cache === "object") {
    const parts = Object.entries(status.cache).filter(([, v]) => typeof v === "number")
      .map(([k, v]) => `${k.replace(/_/g, " ")} ${v.toLocaleString()}`);
    text += "; object-storage cache: " + parts.join(", ");
  }
  document.getElementById("summary").textContent = text;
}

function render(data) {
  const banner = document.getElementById("connection");
  const status = data.status;
  if (data.answering) {
    banner.className = "state";
    banner.textContent = `server pid ${status.pid}, up ${Math.round(status.uptime_s)} s, ` +
      `${status.jobs.length} job(s) · updated ${clock(data.now)}`;
  } else if (status) {
    banner.className = "state down";
    banner.textContent = `the server stopped answering at ${clock(data.down_since)} (${data.error}); ` +
      "showing its last state until a server answers again";
  } else {
    banner.className = "state down";
    banner.textContent = `no server answers (${data.error}); waiting for one to start`;
  }
  if (status) renderJobs(status);
  renderCharts(data);
  document.getElementById("events").replaceChildren(
    ...data.events.slice(-8).reverse().map((e) => el("li", `${clock(e.t)}: ${e.text}`)));
}

async function poll() {
  try {
    const reply = await fetch("/api/status", {cache: "no-store", credentials: "same-origin"});
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    render(await reply.json());
  } catch (err) {
    const banner = document.getElementById("connection");
    banner.className = "state down";
    banner.textContent = `the dashboard does not answer (${err.message}); is \`globalloader status --web\` still running?`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
