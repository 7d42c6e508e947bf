// The tidegate console: polls the admin JSON API and draws what it answers. Everything that
// comes from the server is written as text (textContent), never parsed as HTML.
"use strict";

(function () {
  const body = document.body;
  const operator = body.dataset.operator;
  const pollMs = Number(body.dataset.pollMs) || 1000;
  const classes = (body.dataset.classes || "").split(" ").filter(Boolean);
  const history = { inFlight: [], errors: [], latency: [] };
  const KEEP = 60;
  let previous = null;
  let pendingMode = null;

  function el(tag, text, attrs) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    return node;
  }

  function fill(tableId, rows) {
    const tbody = document.querySelector("#" + tableId + " tbody");
    tbody.replaceChildren(...rows);
  }

  function row(cells, attrs) {
    const tr = el("tr", null, attrs);
    for (const cell of cells) tr.append(cell instanceof Node ? cell : el("td", cell));
    return tr;
  }

  async function getJson(path) {
    const answer = await fetch(path, { headers: { Accept: "application/json" } });
    if (answer.status === 401) {
      window.location.assign("/console");
      throw new Error("signed out");
    }
    if (!answer.ok) return null;
    return answer.json();
  }

  function spark(id, values) {
    const svg = document.getElementById(id);
    const width = 240, height = 40;
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    const top = Math.max(1e-9, ...values);
    const step = width / Math.max(1, KEEP - 1);
    const points = values.map((v, i) => (i * step).toFixed(1) + "," + (height - 2 - (v / top) * (height - 4)).toFixed(1));
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", points.join(" "));
    svg.replaceChildren(line);
  }

  function remember(series, value) {
    series.push(value);
    if (series.length > KEEP) series.shift();
  }

  function drawStats(stats) {
    document.getElementById("answer-mode").textContent = stats.answer_mode;
    document.getElementById("in-flight").textContent = stats.in_flight;
    remember(history.inFlight, stats.in_flight);
    if (previous !== null) {
      const errors = Math.max(0, stats.errors - previous.errors);
      const count = stats.latency_count - previous.latency_count;
      const mean = count > 0 ? (stats.latency_sum - previous.latency_sum) / count : 0;
      remember(history.errors, errors);
      remember(history.latency, mean);
      document.getElementById("errors").textContent = errors;
      document.getElementById("latency").textContent = (mean * 1000).toFixed(1) + " ms";
    }
    previous = stats;
    spark("spark-in-flight", history.inFlight);
    spark("spark-errors", history.errors);
    spark("spark-latency", history.latency);
  }

  function drawBreakers(breakers) {
    fill("breakers", Object.entries(breakers).map(([name, b]) => {
      const details = Object.entries(b).filter(([k, v]) => k !== "state" && k !== "name" && v !== null)
        .map(([k, v]) => k + "=" + (typeof v === "number" ? Number(v.toFixed(3)) : v)).join(" ");
      return row([name, el("td", b.state, { class: "state " + b.state }), details],
        { "data-provider": name, "data-state": b.state });
    }));
  }

  function drawAdmission(admission) {
    document.getElementById("slots").textContent = admission.in_flight;
    fill("admission", (classes.length ? classes : Object.keys(admission.depth)).map((klass) => {
      const refused = admission.refused[klass] || {};
      const total = Object.values(refused).reduce((a, b) => a + b, 0);
      const reasons = Object.entries(refused).map(([k, v]) => k + " " + v).join(", ");
      return row([klass, admission.depth[klass], total + (reasons ? " (" + reasons + ")" : "")],
        { "data-class": klass });
    }));
  }

  function drawRollouts(rollouts, decisions) {
    fill("rollouts", Object.entries(rollouts).map(([route, r]) => {
      const d = decisions[route];
      const last = d ? d.new + ": " + d.why + " (" + new Date(d.at * 1000).toLocaleTimeString() + ")" : "none yet";
      return row([route, r.state, r.share, last], { "data-route": route });
    }));
  }

  function drawFlags(flags) {
    fill("flags", Object.entries(flags).map(([name, f]) =>
      row([name, JSON.stringify(f.value), JSON.stringify(f.default), f.description], { "data-flag": name })));
  }

  function drawAudit(audit) {
    fill("audit", audit.map((a) => row([new Date(a.at * 1000).toLocaleString(), a.flag,
      JSON.stringify(a.old), JSON.stringify(a.new), a.who, a.why])));
  }

  function drawObjects(panelId, tableId, data) {
    const panel = document.getElementById(panelId);
    const rows = Array.isArray(data) ? data : (data && (data.keys || data.rows || data.groups)) || null;
    if (!Array.isArray(rows)) { panel.hidden = true; return; }
    panel.hidden = false;
    const columns = rows.length ? Object.keys(rows[0]).filter((k) => typeof rows[0][k] !== "object") : [];
    const head = document.querySelector("#" + tableId + " thead");
    head.replaceChildren(row(columns.map((c) => el("th", c))));
    fill(tableId, rows.map((r) => row(columns.map((c) => r[c]))));
  }

  async function refresh() {
    try {
      const [stats, breakers, admission, rollouts, flags, audit] = await Promise.all([
        getJson("/console/stats.json"), getJson("/admin/breakers"), getJson("/admin/admission"),
        getJson("/admin/rollouts"), getJson("/admin/flags"), getJson("/admin/audit?limit=20"),
      ]);
      if (stats) drawStats(stats);
      if (breakers) drawBreakers(breakers);
      if (admission) drawAdmission(admission);
      if (rollouts && stats) drawRollouts(rollouts, stats.decisions);
      if (flags) drawFlags(flags);
      if (audit) drawAudit(audit);
      const [keys, spend] = await Promise.all([getJson("/admin/keys"), getJson("/admin/spend?group_by=key")]);
      drawObjects("keys-panel", "keys", keys);
      drawObjects("spend-panel", "spend", spend);
      document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (error) {
      document.getElementById("updated").textContent = "not updated: " + error.message;
    }
  }

  function askToSwitch(mode) {
    pendingMode = mode;
    document.getElementById("confirm-mode").textContent = mode;
    document.getElementById("confirm-problem").textContent = "";
    document.getElementById("confirm").hidden = false;
    document.getElementById("confirm-why").focus();
  }

  async function confirmSwitch() {
    const why = document.getElementById("confirm-why").value.trim();
    const problem = document.getElementById("confirm-problem");
    if (!why) { problem.textContent = "Say why: it goes into the audit history."; return; }
    const answer = await fetch("/admin/kill-switch", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ mode: pendingMode, who: operator, why: why }),
    });
    if (!answer.ok) {
      const error = await answer.json().catch(() => ({}));
      problem.textContent = (error.error && error.error.message) || "refused: " + answer.status;
      return;
    }
    document.getElementById("confirm").hidden = true;
    document.getElementById("confirm-why").value = "";
    pendingMode = null;
    await refresh();
  }

  for (const button of document.querySelectorAll("#kill-switch [data-mode]")) {
    button.addEventListener("click", () => askToSwitch(button.dataset.mode));
  }
  document.getElementById("confirm-yes").addEventListener("click", confirmSwitch);
  document.getElementById("confirm-no").addEventListener("click", () => {
    document.getElementById("confirm").hidden = true;
    pendingMode = null;
  });
  refresh();
  window.setInterval(refresh, pollMs);
})();
