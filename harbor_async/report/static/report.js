// harbor-async report: the task table, its filters, and the episode view.
//
// Safety: every piece of data reaches the page through textContent (el() and
// text nodes) or a numeric style value, never innerHTML, so a transcript full
// of HTML or script tags shows as text and runs nothing.
(() => {
  "use strict";

  const PAGE = 200;        // task rows added per "show more"
  const FOLD_LINES = 24;   // longer texts are folded, their first lines shown
  const FOLD_CHARS = 3000;
  const HEAD_LINES = 10;
  const EP_BUTTONS = 40;   // episode buttons shown in a row before "+N"

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  const fmt = (v, digits = 3) => (v === null || v === undefined || Number.isNaN(v) ? "-" : Number(v).toFixed(digits));
  const secs = (v) => (v === null || v === undefined ? "-" : v < 1 ? (v * 1e3).toFixed(1) + " ms" : v.toFixed(2) + " s");

  // Any table.sortable (rendered by the template): click a heading to sort by it.
  function makeSortable(table) {
    const heads = Array.from(table.tHead ? table.tHead.rows[0].cells : []);
    heads.forEach((th, column) => {
      th.addEventListener("click", () => {
        const desc = th.classList.contains("asc");
        heads.forEach((h) => h.classList.remove("asc", "desc"));
        th.classList.add(desc ? "desc" : "asc");
        const body = table.tBodies[0];
        const key = (row) => {
          const cell = row.cells[column];
          if (!cell) return "";
          const v = cell.dataset.v !== undefined ? cell.dataset.v : cell.textContent.trim();
          const n = parseFloat(v);
          return v !== "" && !Number.isNaN(n) && /^[-+]?[\d.]/.test(v) ? n : v.toLowerCase();
        };
        const rows = Array.from(body.rows).map((row) => [key(row), row]);
        rows.sort((x, y) => compare(x[0], y[0]) * (desc ? -1 : 1));
        body.append(...rows.map((r) => r[1]));
      });
    });
  }

  function compare(a, b) {
    if (a === b) return 0;
    if (a === "" || a === null || a === undefined) return 1;   // blanks last
    if (b === "" || b === null || b === undefined) return -1;
    if (typeof a === "number" && typeof b === "number") return a - b;
    if (typeof a === "number") return -1;
    if (typeof b === "number") return 1;
    return String(a).localeCompare(String(b), undefined, { numeric: true });
  }

  document.querySelectorAll("table.sortable").forEach(makeSortable);

  const dataNode = document.getElementById("report-data");
  if (!dataNode) return; // a benchmark report: sortable tables only
  const DATA = JSON.parse(dataNode.textContent);
  const EPISODES = DATA.episodes;
  const TASKS = DATA.tasks;

  // ---- state, kept in the URL's hash so a reload (view refreshes) or a link keeps it ----
  const state = { failed: false, error: "", group: "", glob: "", sort: "", desc: false, ep: null };

  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    state.failed = p.get("failed") === "1";
    state.error = p.get("error") || "";
    state.group = p.get("group") || "";
    state.glob = p.get("task") || "";
    state.sort = p.get("sort") || "";
    state.desc = p.get("desc") === "1";
    const ep = p.get("ep");
    state.ep = ep !== null && /^\d+$/.test(ep) && +ep < EPISODES.length ? +ep : null;
  }

  function writeHash() {
    const p = new URLSearchParams();
    if (state.failed) p.set("failed", "1");
    if (state.error) p.set("error", state.error);
    if (state.group) p.set("group", state.group);
    if (state.glob) p.set("task", state.glob);
    if (state.sort) p.set("sort", state.sort);
    if (state.desc) p.set("desc", "1");
    if (state.ep !== null) p.set("ep", String(state.ep));
    const hash = p.toString();
    history.replaceState(null, "", hash ? "#" + hash : location.pathname + location.search);
  }

  // ---- the task table ----
  const tbody = document.querySelector("#task-table tbody");
  const count = document.getElementById("f-count");
  const more = document.getElementById("more");
  const fFailed = document.getElementById("f-failed");
  const fError = document.getElementById("f-error");
  const fGroup = document.getElementById("f-group");
  const fGlob = document.getElementById("f-glob");
  let shown = [];
  let limit = PAGE;

  for (const e of DATA.errors) fError.append(el("option", { value: e, text: e }));
  if (fGroup) for (const g of DATA.groups) fGroup.append(el("option", { value: g, text: g }));

  // A glob (* ? [...]) matches the whole name; plain text matches anywhere in it.
  function globTest(pattern) {
    if (!pattern) return () => true;
    const lower = pattern.toLowerCase();
    if (!/[*?[]/.test(pattern)) return (name) => name.toLowerCase().includes(lower);
    let re = "";
    for (let i = 0; i < lower.length; i++) {
      const c = lower[i];
      if (c === "*") re += ".*";
      else if (c === "?") re += ".";
      else if (c === "[") {
        const end = lower.indexOf("]", i + 2);
        if (end < 0) { re += "\\["; continue; }
        let body = lower.slice(i + 1, end).replace(/\\/g, "\\\\");
        if (body[0] === "!") body = "^" + body.slice(1);
        re += "[" + body + "]";
        i = end;
      } else re += c.replace(/[.+^${}()|\\\]]/g, "\\$&");
    }
    let regex;
    try { regex = new RegExp("^" + re + "$"); } catch (err) { return () => false; }
    return (name) => regex.test(name.toLowerCase());
  }

  function sortKey(row, key) {
    if (key === "errors") return Object.values(row.errors).reduce((a, b) => a + b, 0);
    return row[key];
  }

  function filtered() {
    const match = globTest(state.glob);
    const rows = TASKS.filter((t) =>
      (!state.failed || t.failed > 0) &&
      (!state.error || (t.errors[state.error] || 0) > 0) &&
      (!state.group || t.group === state.group) &&
      (match(t.task) || match(t.path)));
    if (state.sort) {
      const sign = state.desc ? -1 : 1;
      rows.sort((a, b) => compare(sortKey(a, state.sort), sortKey(b, state.sort)) * sign);
    }
    return rows;
  }

  function episodeButton(i) {
    const e = EPISODES[i];
    return el("button", {
      type: "button",
      class: "ep o-" + e.o + (state.ep === i ? " current" : ""),
      title: `attempt ${e.a}: ${e.o}, reward ${fmt(e.r)}`,
      "data-ep": i,
      onclick: () => openEpisode(i, true),
    }, "#" + e.a);
  }

  function taskRow(t) {
    const errors = el("td");
    for (const [cls, n] of Object.entries(t.errors)) errors.append(el("span", { class: "chip o-" + cls }, `${cls} ${n}`));
    const eps = el("td", { class: "eps" });
    const first = t.episodes.slice(0, EP_BUTTONS);
    for (const i of first) eps.append(episodeButton(i));
    if (t.episodes.length > first.length) {
      const rest = el("button", { type: "button", class: "ep o-more", text: `+${t.episodes.length - first.length}` });
      rest.addEventListener("click", () => {
        rest.remove();
        for (const i of t.episodes.slice(EP_BUTTONS)) eps.append(episodeButton(i));
      });
      eps.append(rest);
    }
    return el("tr", { "data-task": t.path },
      fGroup ? el("td", { text: t.group }) : null,
      el("td", { class: "name", title: t.path, text: t.task }),
      el("td", { text: t.n }),
      el("td", { text: fmt(t.mean) }),
      el("td", { text: t.solved }),
      el("td", { text: t.failed }),
      errors,
      el("td", { text: secs(t.secs) }),
      eps);
  }

  function renderTable() {
    shown = filtered();
    const fragment = document.createDocumentFragment();
    for (const t of shown.slice(0, limit)) fragment.append(taskRow(t));
    tbody.replaceChildren(fragment);
    count.textContent = `${Math.min(limit, shown.length)} shown of ${shown.length} matching (${TASKS.length} rows)`;
    more.hidden = shown.length <= limit;
    more.textContent = `show ${Math.min(PAGE, shown.length - limit)} more`;
    document.querySelectorAll("#task-table th[data-key]").forEach((th) => {
      th.classList.toggle("asc", th.dataset.key === state.sort && !state.desc);
      th.classList.toggle("desc", th.dataset.key === state.sort && state.desc);
    });
  }

  function onFilter() {
    state.failed = fFailed.checked;
    state.error = fError.value;
    state.group = fGroup ? fGroup.value : "";
    state.glob = fGlob.value.trim();
    limit = PAGE;
    writeHash();
    renderTable();
  }

  fFailed.addEventListener("change", onFilter);
  fError.addEventListener("change", onFilter);
  if (fGroup) fGroup.addEventListener("change", onFilter);
  fGlob.addEventListener("input", onFilter);
  document.getElementById("filters").addEventListener("submit", (ev) => ev.preventDefault());
  more.addEventListener("click", () => { limit += PAGE; renderTable(); });
  document.querySelectorAll("#task-table th[data-key]").forEach((th) => {
    th.addEventListener("click", () => {
      state.desc = state.sort === th.dataset.key ? !state.desc : false;
      state.sort = th.dataset.key;
      writeHash();
      renderTable();
    });
  });

  function applyState() {
    fFailed.checked = state.failed;
    fError.value = state.error;
    if (fGroup) fGroup.value = state.group;
    fGlob.value = state.glob;
    renderTable();
  }

  // ---- the episode view ----
  const panel = document.getElementById("episode");
  const body = document.getElementById("ep-body");
  const title = document.getElementById("ep-title");
  const cache = new Map();
  let opening = 0;

  const domReady = new Promise((resolve) => {
    if (document.readyState !== "loading") resolve();
    else document.addEventListener("DOMContentLoaded", resolve, { once: true });
  });

  async function details(i) {
    if (cache.has(i)) return cache.get(i);
    let node = document.getElementById("ep-" + i);
    if (!node) { await domReady; node = document.getElementById("ep-" + i); }
    if (!node) throw new Error("no data for episode " + i);
    const binary = atob(node.textContent.trim());
    const bytes = new Uint8Array(binary.length);
    for (let k = 0; k < binary.length; k++) bytes[k] = binary.charCodeAt(k);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    const value = JSON.parse(await new Response(stream).text());
    cache.set(i, value);
    return value;
  }

  function folded(text, cls) {
    text = text === null || text === undefined ? "" : String(text);
    const lines = text.split("\n");
    if (lines.length <= FOLD_LINES && text.length <= FOLD_CHARS) return el("pre", { class: cls, text });
    let head = lines.slice(0, HEAD_LINES).join("\n");
    if (head.length > FOLD_CHARS / 3) head = head.slice(0, FOLD_CHARS / 3);
    return el("div", { class: "fold" },
      el("pre", { class: "head " + (cls || ""), text: head + "\n…" }),
      el("details", {},
        el("summary", { text: `show all ${lines.length} lines (${text.length} characters)` }),
        el("pre", { class: cls, text })));
  }

  function contentNode(content) {
    if (content === null || content === undefined || content === "") return null;
    if (typeof content === "string") return folded(content);
    if (Array.isArray(content)) {
      const box = el("div");
      for (const part of content) {
        if (part && part.type === "text") box.append(folded(part.text));
        else if (part && part.type === "image_url") box.append(el("div", { class: "empty", text: "[image]" }));
        else box.append(folded(JSON.stringify(part, null, 2)));
      }
      return box;
    }
    return folded(JSON.stringify(content, null, 2));
  }

  // A tool call's arguments as a reader wants them: each string argument as its own text (a
  // command's newlines as lines, not "\n"), anything else as indented JSON.
  function prettyArguments(args) {
    let value = args;
    if (typeof args === "string") {
      try { value = JSON.parse(args); } catch (err) { return args; }
    }
    if (value && typeof value === "object" && !Array.isArray(value)) {
      return Object.entries(value)
        .map(([k, v]) => (typeof v === "string" ? (v.includes("\n") ? `${k}:\n${v}` : `${k}: ${v}`) : `${k}: ${JSON.stringify(v, null, 2)}`))
        .join("\n");
    }
    return JSON.stringify(value, null, 2);
  }

  function messageNode(m, n) {
    const role = String(m.role || "?");
    const who = [role];
    if (m.name) who.push(String(m.name));
    if (role === "tool" && m.tool_call_id) who.push("result of " + m.tool_call_id);
    const node = el("div", { class: "msg role-" + role.replace(/[^a-z_]/gi, ""), "data-turn": n },
      el("div", { class: "who", text: `${n + 1}. ${who.join(" · ")}` }));
    const reasoning = m.reasoning_content || m.reasoning;
    if (reasoning) node.append(el("details", {}, el("summary", { text: "reasoning" }), folded(reasoning)));
    const content = contentNode(m.content);
    if (content) node.append(content);
    for (const call of m.tool_calls || []) {
      const fn = call.function || {};
      node.append(el("div", { class: "toolcall" },
        el("div", { class: "fn", text: `→ ${fn.name || call.type || "call"}(${call.id || ""})` }),
        folded(prettyArguments(fn.arguments))));
    }
    if (!content && !(m.tool_calls || []).length && !reasoning) node.append(el("div", { class: "empty", text: "(empty)" }));
    return node;
  }

  function timeline(phases) {
    const box = el("div", { class: "timeline" });
    const total = Math.max(0, ...phases.map((p) => p.end));
    for (const p of phases) {
      const bar = el("div", { class: "bar p-" + String(p.phase).replace(/[^a-z_]/gi, ""), title: `${p.phase}: ${secs(p.start)} → ${secs(p.end)}` });
      bar.style.left = (total > 0 ? (100 * p.start) / total : 0) + "%";
      bar.style.width = (total > 0 ? (100 * (p.end - p.start)) / total : 0) + "%";
      box.append(el("div", { class: "lane" }, el("span", { text: p.phase }), el("div", { class: "track" }, bar), el("span", { text: secs(p.end - p.start) })));
    }
    box.append(el("div", { class: "lane" }, el("span", { text: "episode" }), el("span"), el("span", { text: secs(total) })));
    return box;
  }

  function kv(pairs) {
    const table = el("table", { class: "kv" });
    for (const [k, v] of pairs) {
      if (v === null || v === undefined || v === "") continue;
      table.append(el("tr", {}, el("th", { text: k }), el("td", { text: typeof v === "object" ? JSON.stringify(v) : v })));
    }
    return table;
  }

  function renderEpisode(i, d) {
    const e = EPISODES[i];
    title.textContent = `${d.task} · attempt ${d.attempt}` + (DATA.groups.length > 1 ? ` · ${e.g}` : "");
    const rewards = el("table", { class: "data", id: "ep-rewards" },
      el("thead", {}, el("tr", {}, el("th", { text: "reward" }), el("th", { text: "value" }))));
    const rbody = el("tbody");
    rbody.append(el("tr", {}, el("td", { text: "episode reward" }), el("td", { text: d.reward === null ? "- (not judged)" : String(d.reward) })));
    for (const [k, v] of Object.entries(d.rewards || {})) rbody.append(el("tr", {}, el("td", { text: k }), el("td", { text: String(v) })));
    rewards.append(rbody);
    const parts = [
      el("div", { class: "meta" },
        kv([["outcome", e.o], ["task path", d.task_path], ["agent", d.agent], ["model", d.model], ["checkpoint", d.checkpoint],
            ["sandbox", d.sandbox], ["start attempts", d.start_attempts], ["started at", d.started_at],
            ["finish reason", d.finish_reason], ["usage", Object.keys(d.usage || {}).length ? d.usage : null],
            ["resources", d.resources || null]]),
        rewards),
    ];
    if (d.error_class || d.error) {
      parts.push(el("h3", { text: `error: ${d.error_class || "?"}` + (d.error_phase ? ` in ${d.error_phase}` : "") + (d.error_type ? ` (${d.error_type})` : "") }));
      parts.push(folded(d.error || "", "error"));
    }
    if ((d.steps || []).length) {  // a multi-step task: each step that ran, its reward and why the task ended there
      const steps = el("table", { class: "data", id: "ep-steps" },
        el("thead", {}, el("tr", {}, ...["step", "reward", "rewards", "note"].map((h) => el("th", { text: h })))));
      const sbody = el("tbody");
      for (const s of d.steps) {
        sbody.append(el("tr", {}, el("td", { text: String(s.name) }),
          el("td", { text: s.reward === null || s.reward === undefined ? "-" : String(s.reward) }),
          el("td", { text: JSON.stringify(s.rewards || {}) }), el("td", { text: s.error ? String(s.error) : "" })));
      }
      steps.append(sbody);
      parts.push(el("h3", { text: `steps (${d.steps.length})` }), steps);
    }
    if ((d.phases || []).length) parts.push(el("h3", { text: "phases" }), timeline(d.phases));
    parts.push(el("h3", { text: "verifier output" }));
    parts.push(d.verifier_output ? folded(d.verifier_output) : el("div", { class: "empty", text: "(none recorded)" }));
    const transcript = el("div", { id: "transcript" });
    (d.transcript || []).forEach((m, n) => transcript.append(messageNode(m && typeof m === "object" ? m : { role: "?", content: String(m) }, n)));
    parts.push(el("h3", { text: `transcript (${(d.transcript || []).length} messages)` }));
    parts.push((d.transcript || []).length ? transcript : el("div", { class: "empty", text: "(no transcript in this record)" }));
    body.replaceChildren(...parts);
  }

  async function openEpisode(i, scroll) {
    const ticket = ++opening;
    state.ep = i;
    writeHash();
    document.querySelectorAll("button.ep.current").forEach((b) => b.classList.remove("current"));
    document.querySelectorAll(`button.ep[data-ep="${i}"]`).forEach((b) => b.classList.add("current"));
    panel.hidden = false;
    title.textContent = "loading…";
    let d;
    try {
      d = await details(i);
    } catch (err) {
      if (ticket !== opening) return;
      body.replaceChildren(el("pre", { class: "error", text: "cannot decode this episode: " + err }));
      return;
    }
    if (ticket !== opening) return; // another episode was opened meanwhile
    renderEpisode(i, d);
    panel.dataset.episode = String(i);
    if (scroll) panel.scrollIntoView({ block: "start" });
  }

  function closeEpisode() {
    opening++;
    state.ep = null;
    panel.hidden = true;
    delete panel.dataset.episode;
    document.querySelectorAll("button.ep.current").forEach((b) => b.classList.remove("current"));
    writeHash();
  }

  // Previous and next follow the table as filtered and sorted now.
  function step(delta) {
    const order = shown.flatMap((t) => t.episodes);
    if (!order.length) return;
    const at = order.indexOf(state.ep);
    const next = order[(at < 0 ? 0 : at + delta + order.length) % order.length];
    openEpisode(next, true);
  }

  document.getElementById("ep-close").addEventListener("click", closeEpisode);
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && !panel.hidden) closeEpisode();
  });
  document.getElementById("ep-prev").addEventListener("click", () => step(-1));
  document.getElementById("ep-next").addEventListener("click", () => step(1));
  window.addEventListener("hashchange", () => {
    readHash();
    applyState();
    if (state.ep !== null) openEpisode(state.ep, false); else if (!panel.hidden) closeEpisode();
  });

  readHash();
  applyState();
  if (state.ep !== null) openEpisode(state.ep, false);
  window.harborReport = { openEpisode, closeEpisode, data: DATA }; // for tests and the console
})();
