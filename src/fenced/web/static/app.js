// The fenced dashboard: the held claims, refreshed; a claim's runs as a timeline.
// Every value from the API is shown with textContent or as an SVG attribute: never
// parsed as markup. Nothing is loaded from anywhere but this server.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const OUTCOMES = ["running", "ok", "failed", "lost", "released", "retried", "aborted", "skipped"];
  const state = { config: null, selected: null, timer: null, token: "", since: null,
    target: null };

  function $(id) { return document.getElementById(id); }

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  function seconds(s) {
    if (s === null || s === undefined) return "";
    if (typeof s !== "number") return String(s); // "inf" from a record nobody checked
    if (s < 10) return s.toFixed(1) + "s";
    if (s < 60) return Math.round(s) + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + String(Math.round(s % 60)).padStart(2, "0") + "s";
    return Math.floor(s / 3600) + "h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  }

  function clock(t) {
    if (!t) return "";
    return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
  }

  function holderText(h) {
    if (!h) return "";
    if (h.unreadable) return "unknown (" + h.unreadable + ")";
    let text = h.host + " pid " + (h.pid === null ? "?" : h.pid);
    if (h.task_id) text += " task " + h.task_id;
    return text;
  }

  function slotText(s) {
    let text = "slot " + s.slot + ": " + holderText(s) + " · token " + s.token;
    if (s.expires_in !== null && s.expires_in !== undefined) text += " · " + seconds(s.expires_in) + " left";
    return text;
  }

  // What holds a name's next start back: its rate, a pending debounce burst.
  function pendingLines(c, until) {
    const lines = [];
    if (c.rate) {
      const wait = "next start in " + seconds(c.rate.wait);
      lines.push(until ? "rate limited until " + clock(c.rate.next_start) + ", " + wait :
        "rate limited: " + wait);
    }
    if (c.burst) {
      const b = c.burst;
      const calls = typeof b.calls === "number" ? b.calls + (b.calls === 1 ? " call" : " calls") :
        "calls ?";
      const runs = typeof b.runs_in !== "number" ? "due ?" :
        b.runs_in > 0 ? "runs in " + seconds(b.runs_in) : "due now";
      lines.push("burst pending: " + calls + ", " + runs + " (task " + b.task_id + ")");
    }
    return lines;
  }

  function badge(outcome) {
    const name = outcome || "";
    const cls = OUTCOMES.includes(name) || name === "unfinished" ? name : "unreadable";
    return el("span", name, "badge " + cls);
  }

  async function getJSON(path) {
    let response;
    try {
      response = await fetch(path, { headers: { Accept: "application/json" } });
    } catch (err) {
      throw new Error("cannot reach fenced web (" + err.message + ")");
    }
    const data = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error(data.error || response.status + " " + response.statusText);
    return data;
  }

  function status(text, bad) {
    const node = $("status");
    node.textContent = text;
    node.classList.toggle("bad", Boolean(bad));
  }

  // -- the claims table -----------------------------------------------------------------

  function renderClaims(data) {
    const body = $("claims").tBodies[0];
    const rows = [];
    for (const c of data.claims) {
      const path = encodeURIComponent(c.name);
      const tr = el("tr");
      tr.dataset.name = c.name;
      tr.dataset.path = path;
      if (c.alert) {
        tr.classList.add("alert");
        tr.title = c.skips + " consecutive skips (alert at " + data.alert_after_skips + ")";
      }
      if (path === state.selected) tr.classList.add("selected");
      tr.append(el("td", c.name, "name"));
      const who = el("td");
      if (c.slots.length > 1) {
        // A name held by several at once: each holder, by slot.
        who.append(el("div", c.slots.length + "/" + c.limit + " slots held"));
        for (const s of c.slots) who.append(el("div", "slot " + s.slot + ": " + holderText(s), "slot"));
      } else {
        let text = holderText(c.holder);
        if (c.limit > 1) text += "  (" + c.slots.length + "/" + c.limit + " slots)";
        if (!c.holder && c.cooldown_left) text = "cooldown, " + seconds(c.cooldown_left) + " left";
        if (!c.holder && !c.cooldown_left && c.queued) text = "";
        who.textContent = text;
      }
      if (c.queued) {
        // claim_enqueue: a message for the name is queued (or runs, until_finished)
        let mark = "queued: task " + c.queued.task_id;
        if (c.queued.expires_in) mark += ", marked " + seconds(c.queued.expires_in) + " more";
        who.append(el("div", mark, "slot"));
      }
      // A beat's leader claim (fenced.celery.beat)
      if (c.beat !== null && c.beat !== undefined) {
        who.append(el("div", "beat leader (fenced beat " + c.beat + ")", "slot"));
      }
      for (const line of pendingLines(c, false)) who.append(el("div", line, "slot pending"));
      tr.append(who);
      tr.append(el("td", seconds(c.age), "num"));
      tr.append(el("td", seconds(c.expires_in), "num"));
      tr.append(el("td", c.fence === null ? "" : c.fence, "num"));
      const skips = el("td", c.skips, "num skips");
      if (c.alert) skips.prepend(el("span", "alert", "badge lost"), " ");
      tr.append(skips);
      const last = el("td");
      if (c.last_outcome) last.append(badge(c.last_outcome));
      if (c.unreadable) last.append(el("span", " unreadable: " + c.unreadable));
      tr.append(last);
      tr.addEventListener("click", () => select(path, c.name));
      rows.push(tr);
    }
    body.replaceChildren(...rows);
    $("empty").hidden = data.claims.length > 0;
    const held = data.claims.filter((c) => c.holder).length;
    $("claims-title").textContent = held + " held in namespace " + data.namespace;
  }

  // -- one claim: holder, timeline, runs --------------------------------------------------

  // A claim is kept as its API path segment (the name percent-encoded, "/" as %2F).
  function select(path, name) {
    state.selected = path;
    history.replaceState(null, "", "#claim=" + path);
    $("detail").hidden = false;
    $("detail-name").textContent = name;
    $("release-message").textContent = "";
    $("release-holder").replaceChildren();
    delete $("release-holder").dataset.key;
    state.target = null;
    $("release-target").textContent = "";
    for (const tr of $("claims").tBodies[0].rows) {
      tr.classList.toggle("selected", tr.dataset.path === path);
    }
    refreshDetail().catch(() => {});
  }

  function selectFromHash() {
    const hash = location.hash.match(/^#claim=(.+)$/);
    if (!hash) return;
    let name;
    try {
      name = decodeURIComponent(hash[1]);
    } catch (err) {
      status("the address names no claim (" + hash[1] + "): pick one in the table", true);
      return;
    }
    select(encodeURIComponent(name), name);
  }

  async function refreshDetail() {
    const name = state.selected;
    if (name === null) return;
    const path = "/api/claims/" + name;
    let detail, runs;
    try {
      [detail, runs] = await Promise.all([getJSON(path), getJSON(path + "/runs")]);
    } catch (err) {
      $("detail-holder").textContent = err.message;
      throw err;
    }
    if (name !== state.selected) return;
    $("detail-name").textContent = detail.name;
    let line = detail.holder ? "held by " + holderText(detail.holder) : "not held";
    if (detail.holder && detail.holder.expires_in !== null) {
      line += ", " + seconds(detail.holder.expires_in) + " left";
    }
    if (detail.limit > 1) line += " · limit " + detail.limit;
    for (const pending of pendingLines(detail, true)) line += " · " + pending;
    line += " · " + detail.skips + " consecutive skips";
    $("detail-holder").textContent = line;
    $("detail-holder").classList.toggle("alert", Boolean(detail.alert));
    renderSlots(detail.slots);
    renderBeat(detail.beat);
    renderTarget(detail.slots);
    drawTimeline(runs);
    renderRuns(runs.runs);
  }

  // A beat's leader claim: the beat's last tick, each entry's last due time and next one.
  function renderBeat(beat) {
    const node = $("detail-beat");
    node.hidden = !beat;
    if (!beat) {
      node.replaceChildren();
      return;
    }
    const items = [el("li", "leader of beat " + beat.beat + (beat.last_tick ?
      " · last tick " + beat.last_tick : "") + " (fenced beat " + beat.beat + ")")];
    for (const [entry, e] of Object.entries(beat.entries)) {
      items.push(el("li", entry + ": last due " + e.due + " " + e.state + " (fence " + e.fence +
        ")" + (e.next ? " · next " + e.next : "")));
    }
    node.replaceChildren(...items);
  }

  function renderSlots(slots) {
    const several = slots.length > 1;
    $("detail-slots").hidden = !several;
    $("detail-slots").replaceChildren(...(several ? slots.map((s) => el("li", slotText(s))) : []));
    // A release of a name held by several names the holder: by the start of its token.
    // Rebuilt only when the holders change: an open list stays open across refreshes.
    // A holder chosen that is gone leaves nothing chosen, never the next one.
    const select = $("release-holder");
    const options = several ? [["", "choose the holder to clear"], ...slots.map((s) =>
      [s.token, "slot " + s.slot + ": " + holderText(s) + " · token " + s.token])] : [];
    const key = JSON.stringify(options);
    if (select.dataset.key !== key) {
      const chosen = select.value;
      select.replaceChildren(...options.map(([token, text]) => {
        const option = el("option", text);
        option.value = token;
        return option;
      }));
      select.value = options.some(([token]) => token === chosen) ? chosen : "";
      select.dataset.key = key;
    }
    $("release-holder-label").hidden = !several;
  }

  // The one holder a release clears: the one shown. The API clears it only if it still
  // holds the name when the release lands.
  function renderTarget(slots) {
    const one = slots.length === 1 ? slots[0] : null;
    const token = one ? one.token : null;
    const node = $("release-target");
    // Said to an operator filling the form: the holder they read is not the one now.
    if (state.target && token !== state.target && $("release-reason").value) {
      const message = $("release-message");
      message.className = "message bad";
      message.textContent = "the holder changed: token " + state.target + " no longer holds " +
        "this claim" + (one ? "; it is held by " + holderText(one) + " · token " + token +
        " now" : "") + ": check before releasing";
    }
    state.target = token;
    node.hidden = slots.length > 1;
    node.textContent = one ? "Clears " + holderText(one) + " · token " + one.token +
      ", and only it" : "Not held: nothing to clear";
  }

  function renderRuns(runs) {
    const rows = runs.map((r) => {
      const tr = el("tr");
      tr.dataset.outcome = r.outcome;
      const first = el("td");
      first.append(badge(r.outcome));
      tr.append(first);
      tr.append(el("td", clock(r.start || r.end)));
      tr.append(el("td", r.outcome === "skipped" ? "" : seconds(r.duration), "num"));
      tr.append(el("td", r.worker || r.holder || ""));
      tr.append(el("td", r.fence === null ? "" : r.fence, "num"));
      tr.append(el("td", r.task_id || "", "mono"));
      const held = r.holder && r.holder !== r.worker && "held by " + r.holder;
      tr.append(el("td", [r.reason, held, r.unreadable && "unreadable: " + r.unreadable]
        .filter(Boolean).join("; ")));
      return tr;
    });
    $("runs").tBodies[0].replaceChildren(...rows);
  }

  function niceStep(span) {
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400];
    return steps.find((s) => span / s <= 8) || 86400;
  }

  function drawTimeline(data) {
    const box = $("timeline");
    const runs = data.runs.filter((r) => typeof (r.start || r.end) === "number");
    if (!runs.length) {
      box.replaceChildren(el("p", "No run records (Claim(records=True) and fenced run keep them).",
        "empty"));
      return;
    }
    const now = data.now;
    const worked = runs.filter((r) => r.outcome !== "skipped");
    const lanes = [];
    const laneOf = (r) => r.worker || r.holder || "?";
    for (const r of worked) {
      const who = laneOf(r);
      if (!lanes.includes(who)) lanes.push(who);
    }
    lanes.reverse(); // oldest holder on top
    const anySkips = runs.length > worked.length;
    const laneNames = anySkips ? ["skips", ...lanes] : lanes;
    let t0 = Math.min(...runs.map((r) => r.start || r.end));
    let t1 = now;
    if (t1 - t0 < 3) t0 = t1 - 3;
    const pad = (t1 - t0) * 0.02;
    t0 -= pad;
    t1 += pad;
    const width = Math.max(640, box.clientWidth || 900);
    const left = 170, right = 16, top = 10, lane = 28, axis = 24;
    const height = top + laneNames.length * lane + axis;
    const x = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - right);
    const root = svg("svg", { width, height, viewBox: "0 0 " + width + " " + height,
      role: "img", "aria-label": "runs of the claim over time" });
    const step = niceStep(t1 - t0);
    for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
      root.append(svg("line", { x1: x(t), x2: x(t), y1: top, y2: height - axis, class: "grid" }));
      const label = svg("text", { x: x(t), y: height - 8, "text-anchor": "middle" });
      label.textContent = clock(t);
      root.append(label);
    }
    laneNames.forEach((name, i) => {
      const label = svg("text", { x: left - 8, y: top + i * lane + lane / 2 + 4,
        "text-anchor": "end", class: "lane-label" });
      label.textContent = name.length > 24 ? name.slice(0, 23) + "…" : name;
      const title = svg("title");
      title.textContent = name;
      label.append(title);
      root.append(label);
    });
    const laneY = (who) => top + laneNames.indexOf(who) * lane;
    for (const r of runs) {
      const title = svg("title");
      const parts = [r.outcome, laneOf(r), clock(r.start) + " → " +
        (r.end ? clock(r.end) : "now")];
      if (r.duration !== null && r.outcome !== "skipped") parts.push(seconds(r.duration));
      if (r.fence !== null) parts.push("fence " + r.fence);
      if (r.reason) parts.push(r.reason);
      if (r.holder && r.holder !== r.worker) parts.push("held by " + r.holder);
      title.textContent = parts.join(" · ");
      if (r.outcome === "skipped") {
        const cx = x(r.start), cy = top + lane / 2;
        const mark = svg("path", { d: `M${cx} ${cy - 6} L${cx + 5} ${cy} L${cx} ${cy + 6} ` +
          `L${cx - 5} ${cy} Z`, class: "skip" });
        mark.append(title);
        root.append(mark);
        continue;
      }
      const y = laneY(laneOf(r)) + 5;
      const took = typeof r.duration === "number" ? r.duration : 0;
      const start = r.start || r.end - took;
      const end = r.end || now;
      const kind = OUTCOMES.includes(r.outcome) ? r.outcome : "unreadable";
      const rect = svg("rect", { x: x(start), y, width: Math.max(3, x(end) - x(start)),
        height: lane - 10, rx: 3, class: "run " + kind, "data-outcome": r.outcome });
      rect.append(title);
      root.append(rect);
      if (r.outcome === "lost" || r.outcome === "released") {
        const ex = x(end), ey = y + (lane - 10) / 2;
        const cross = svg("path", { d: `M${ex - 4} ${ey - 4} L${ex + 4} ${ey + 4} ` +
          `M${ex - 4} ${ey + 4} L${ex + 4} ${ey - 4}`,
          class: (r.outcome === "lost" ? "loss " : "release-mark ") + kind });
        cross.append(title.cloneNode(true));
        root.append(cross);
      }
    }
    root.append(svg("line", { x1: x(now), x2: x(now), y1: top - 4, y2: height - axis,
      class: "now" }));
    box.replaceChildren(root);
  }

  function legend() {
    const items = OUTCOMES.filter((o) => o !== "skipped").map((o) => {
      const span = el("span");
      const swatch = el("span", null, "swatch " + o);
      span.append(swatch, o);
      return span;
    });
    items.push(el("span", "◆ skip   ✕ lost or released"));
    $("legend").replaceChildren(...items);
  }

  // -- release ----------------------------------------------------------------------------

  async function release(event) {
    event.preventDefault();
    const message = $("release-message");
    const path = state.selected;
    const token = $("release-token").value.trim();
    // The holder shown, and only it (the API refuses a release naming no holder).
    const several = !$("release-holder-label").hidden;
    const aimed = several ? $("release-holder").value : state.target;
    if (!aimed) {
      message.className = "message bad";
      message.textContent = several ? "choose the holder to clear" : state.target === "" ?
        "the holder shows no token to name it by: clear it with fenced release" :
        "not held: nothing to clear";
      return;
    }
    const body = { reason: $("release-reason").value, token: aimed };
    message.className = "message";
    message.textContent = "releasing…";
    const headers = { "Content-Type": "application/json", Accept: "application/json" };
    if (token) headers.Authorization = "Bearer " + token;
    try {
      const response = await fetch("/api/claims/" + path + "/release", {
        method: "POST", headers, body: JSON.stringify(body),
      });
      const data = await response.json();
      if (!response.ok) {
        message.className = "message bad";
        message.textContent = "refused (" + response.status + "): " + (data.error || "");
        if (response.status === 409) {
          state.target = null; // the refusal says who holds it now: no second notice
          await refresh();
        }
        return;
      }
      message.className = "message good";
      message.textContent = data.message;
      state.target = null;
      await refresh();
    } catch (err) {
      message.className = "message bad";
      message.textContent = "failed: " + err.message;
    }
  }

  // -- the loop ---------------------------------------------------------------------------

  async function refresh() {
    if (state.since !== null) {
      // The last refresh has no answer yet (a Redis that hangs rather than refuses):
      // say so, and send no second request after it.
      const waited = (Date.now() - state.since) / 1000;
      if (waited > Math.max(2, 2 * state.config.refresh)) {
        status("no answer for " + seconds(waited) + ": Redis (or fenced web) is slow or " +
          "unreachable", true);
      }
      return;
    }
    state.since = Date.now();
    try {
      const data = await getJSON("/api/claims");
      renderClaims(data);
      await refreshDetail();
      status("updated " + new Date().toLocaleTimeString([], { hour12: false }) +
        " · every " + state.config.refresh + "s");
    } catch (err) {
      status(err.message, true);
    } finally {
      state.since = null;
    }
  }

  async function start() {
    state.config = await getJSON("/api/config");
    $("namespace").textContent = "namespace " + state.config.namespace;
    $("redis").textContent = "on " + state.config.redis;
    $("release").hidden = !state.config.allow_release;
    $("release").addEventListener("submit", release);
    $("lookup").addEventListener("submit", (event) => {
      event.preventDefault();
      const name = $("lookup-name").value.trim();
      if (name) select(encodeURIComponent(name), name);
    });
    legend();
    selectFromHash();
    await refresh();
    state.timer = setInterval(refresh, state.config.refresh * 1000);
  }

  document.addEventListener("DOMContentLoaded", () => {
    start().catch((err) => status(err.message, true));
  });
})();
