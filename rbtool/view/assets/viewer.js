// The viewer's pages: the trajectory list (#/ or #/page/N), one trajectory (#/t/ID) with a
// frame player per camera and plots of its per-step series, and the stats page (#/stats).
// Everything comes from this server's /api; text is set as text, never parsed as HTML.
"use strict";

const PAGE = 50;
const main = document.getElementById("main");
let stopPage = () => {}; // undoes the current page's key and resize handlers

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

async function api(path) {
  const response = await fetch(path);
  const doc = await response.json();
  if (!response.ok) throw new Error(doc.error || `HTTP ${response.status}`);
  return doc;
}

function num(v, digits = 4) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  return Number(v.toPrecision(digits)).toString();
}

function show(...nodes) {
  main.replaceChildren(...nodes);
}

function failed(error) {
  show(el("p", { class: "error", text: `Error: ${error.message}` }));
}

function mark(nav) {
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("here", a.id === nav);
}

// ------------------------------------------------------------------ the list
async function listPage(page) {
  mark("nav-list");
  const offset = page * PAGE;
  const doc = await api(`/api/trajectories?offset=${offset}&limit=${PAGE}`);
  const pages = Math.max(1, Math.ceil(doc.total / PAGE));
  const body = el("tbody");
  const cells = new Map();
  for (const row of doc.rows) {
    const ret = el("td", { class: "num", text: "…" });
    const episodes = el("td", { class: "num", text: "…" });
    cells.set(row.id, [ret, episodes]);
    const tr = el(
      "tr",
      { class: "row", "data-id": String(row.id), onclick: () => (location.hash = `#/t/${row.id}`) },
      el("td", { class: "num" }, el("a", { href: `#/t/${row.id}`, text: String(row.id) })),
      el("td", { class: "num", text: `${row.T}×${row.B}` }),
      el("td", { class: "num", text: String(row.num_samples) }),
      el("td", { class: "mono", text: row.model_weights_id ?? "(none)" }),
      ret,
      episodes,
    );
    body.append(tr);
  }
  const pager = el(
    "div",
    { class: "pager" },
    el("button", { text: "◀ previous", onclick: () => (location.hash = `#/page/${page - 1}`) }),
    el("span", { text: `page ${page + 1} of ${pages} · ${doc.total} trajectories` }),
    el("button", { text: "next ▶", onclick: () => (location.hash = `#/page/${page + 1}`) }),
  );
  pager.children[0].disabled = page <= 0;
  pager.children[2].disabled = page + 1 >= pages;
  const head = el(
    "tr",
    {},
    el("th", { class: "num", text: "id" }),
    el("th", { class: "num", text: "T×B" }),
    el("th", { class: "num", text: "samples" }),
    el("th", { text: "model_weights_id" }),
    el("th", { class: "num", text: "return", title: "sum of rewards, mean over env columns" }),
    el("th", { class: "num", text: "episodes", title: "episodes ended, all env columns" }),
  );
  show(
    el("h2", { text: "Trajectories" }),
    el("table", { id: "trajectories" }, el("thead", {}, head), body),
    pager,
    el("p", { class: "note", text: "Return and episodes are read from the files of the rows shown." }),
  );
  // Return and episodes of the rows shown, from their files, a few at a time; no more once
  // another page is shown.
  const ids = doc.rows.map((r) => r.id);
  const shown = body;
  for (let i = 0; i < ids.length && shown.isConnected; i += 10) {
    let found;
    try {
      found = await api(`/api/summaries?ids=${ids.slice(i, i + 10).join(",")}`);
    } catch (error) {
      for (const id of ids.slice(i, i + 10)) cells.get(id)[0].textContent = "?";
      continue;
    }
    for (const row of found.rows) {
      const [ret, episodes] = cells.get(row.id) || [];
      if (!ret) continue;
      if (row.error) {
        ret.textContent = "unreadable";
        ret.title = row.error;
        episodes.textContent = "";
      } else {
        ret.textContent = num(row.return);
        episodes.textContent = String(row.episodes);
      }
    }
  }
}

// ------------------------------------------------------------------ one trajectory
async function trajectoryPage(id) {
  mark("");
  const doc = await api(`/api/trajectory?id=${id}`);
  const entry = doc.entry;
  const state = { env: 0, step: 0, series: null, playing: null };
  const stepInput = el("input", { type: "range", min: "0", max: String(entry.T - 1), value: "0", id: "step" });
  const stepText = el("span", { id: "step-text" });
  const envSelect = el("select", { id: "env" });
  for (let b = 0; b < entry.B; b++) envSelect.append(el("option", { value: String(b), text: `env ${b}` }));
  const play = el("button", { text: "play", id: "play" });
  const player = el("div", { class: "cameras", id: "player" });
  const images = doc.cameras.map((camera) => {
    const scale = Math.max(1, Math.floor(256 / Math.max(camera.height, camera.width)));
    const img = el("img", { alt: camera.field, "data-camera": camera.field });
    img.width = camera.width * scale;
    img.height = camera.height * scale;
    const caption = el("figcaption", { text: `${camera.field} ${camera.height}×${camera.width}` });
    img.addEventListener("error", async () => {
      try {
        await api(img.src); // the server's JSON says why
      } catch (error) {
        caption.textContent = `${camera.field}: ${error.message}`;
        caption.className = "error";
      }
    });
    img.addEventListener("load", () => {
      caption.textContent = `${camera.field} ${camera.height}×${camera.width}`;
      caption.className = "";
    });
    player.append(el("figure", {}, img, caption));
    return [camera, img];
  });
  if (!images.length) player.append(el("p", { class: "note", text: "This trajectory holds no image field." }));
  const plots = el("div", { class: "plots", id: "plots" });
  const canvases = {};
  for (const name of ["rewards", "dones", "actions"]) {
    canvases[name] = el("canvas", { "data-plot": name });
    plots.append(el("div", { class: "plot" }, el("span", { class: "label", text: name }), canvases[name]));
  }
  const seriesNote = el("p", { class: "note" });
  show(
    el("h2", { text: `Trajectory ${entry.id}` }),
    el("p", {
      class: "note",
      text: `T×B ${entry.T}×${entry.B} · ${entry.num_samples} samples · model_weights_id ${entry.model_weights_id ?? "(none)"} · ${entry.checkpoint}`,
    }),
    el(
      "div",
      { class: "controls" },
      envSelect,
      el("button", { text: "◀", title: "previous step", onclick: () => go(state.step - 1) }),
      stepInput,
      el("button", { text: "▶", title: "next step", onclick: () => go(state.step + 1) }),
      play,
      stepText,
      el("span", { class: "keys" }, el("kbd", { text: "←" }), " ", el("kbd", { text: "→" }), " step  ",
        el("kbd", { text: "Home" }), " ", el("kbd", { text: "End" }), "  ",
        el("kbd", { text: "↑" }), " ", el("kbd", { text: "↓" }), " env  ", el("kbd", { text: "space" }), " play"),
    ),
    player,
    plots,
    seriesNote,
  );

  function frameUrl(camera, step) {
    const where = `id=${entry.id}&env=${state.env}&step=${step}&camera=${encodeURIComponent(camera.field)}`;
    return `/api/frame?${where}&run=${doc.run}`; // run: cached frames of an earlier server are not these
  }

  let clickers = {};
  function drawPlots() {
    const s = state.series;
    if (!s) return;
    const common = { steps: s.steps, ends: s.episode_ends, cursor: state.step };
    const drawn = {
      rewards: s.rewards && { lines: [{ values: s.rewards }], kind: "line" },
      dones: s.dones && { lines: [{ values: s.dones.map(Number), color: "#e04f16" }], kind: "bars", lo: 0, hi: 1 },
      actions: s.actions && {
        lines: (s.actions[0] || []).map((_, d) => ({ values: s.actions.map((row) => row[d]) })),
        kind: "line",
      },
    };
    clickers = {};
    for (const [name, spec] of Object.entries(drawn)) {
      const canvas = canvases[name];
      canvas.parentElement.hidden = !spec;
      if (spec) clickers[name] = Plot.steps(canvas, { ...common, ...spec });
    }
  }
  for (const [name, canvas] of Object.entries(canvases)) {
    canvas.addEventListener("click", (event) => clickers[name] && go(clickers[name](event.clientX)));
  }

  function go(step) {
    state.step = Math.max(0, Math.min(entry.T - 1, step));
    stepInput.value = String(state.step);
    stepText.textContent = `step ${state.step} of ${entry.T - 1}`;
    player.dataset.step = String(state.step);
    for (const [camera, img] of images) {
      img.src = frameUrl(camera, state.step);
      if (state.step + 1 < entry.T) new Image().src = frameUrl(camera, state.step + 1); // ahead
    }
    drawPlots();
  }

  async function loadEnv(env) {
    state.env = env;
    envSelect.value = String(env);
    player.dataset.env = String(env);
    state.series = null;
    seriesNote.textContent = "";
    go(state.step);
    try {
      const s = await api(`/api/series?id=${entry.id}&env=${env}`);
      if (state.env !== env) return;
      state.series = s;
      const ret = s.ret === null ? "no rewards" : `return ${num(s.ret)}`;
      const ends = s.episode_ends.length ? `episodes end at steps ${s.episode_ends.join(", ")}` : "no episode ends";
      const what = s.actions ? `${(s.actions[0] || []).length} action dims` : "no actions";
      seriesNote.textContent = `env ${env}: ${ret} · ${ends} (dashed lines) · ${what}`;
      drawPlots();
    } catch (error) {
      seriesNote.textContent = `Error: ${error.message}`;
      seriesNote.className = "error";
    }
  }

  function toggle() {
    if (state.playing) {
      clearInterval(state.playing);
      state.playing = null;
      play.textContent = "play";
      return;
    }
    play.textContent = "pause";
    state.playing = setInterval(() => go(state.step + 1 < entry.T ? state.step + 1 : 0), 200);
  }

  stepInput.addEventListener("input", () => go(Number(stepInput.value)));
  envSelect.addEventListener("change", () => loadEnv(Number(envSelect.value)));
  play.addEventListener("click", toggle);
  function onKey(event) {
    const target = event.target;
    if (target instanceof HTMLInputElement && target.type !== "range") return;
    // a focused button clicks itself on space or Enter; the keys below are the page's (their
    // default actions, the slider's and the selector's own steps, prevented)
    if (target instanceof HTMLButtonElement && (event.key === " " || event.key === "Enter")) return;
    const moves = { ArrowRight: 1, ArrowLeft: -1 };
    if (event.key in moves) go(state.step + moves[event.key]);
    else if (event.key === "Home") go(0);
    else if (event.key === "End") go(entry.T - 1);
    else if (event.key === "ArrowDown" && state.env + 1 < entry.B) loadEnv(state.env + 1);
    else if (event.key === "ArrowUp" && state.env > 0) loadEnv(state.env - 1);
    else if (event.key === " ") toggle();
    else return;
    event.preventDefault();
  }
  document.addEventListener("keydown", onKey);
  window.addEventListener("resize", drawPlots);
  stopPage = () => {
    document.removeEventListener("keydown", onKey);
    window.removeEventListener("resize", drawPlots);
    if (state.playing) clearInterval(state.playing);
  };
  await loadEnv(0);
}

// ------------------------------------------------------------------ stats
function facts(pairs) {
  const dl = el("dl", { class: "facts" });
  for (const [name, value] of pairs) dl.append(el("dt", { text: name }), el("dd", { text: value }));
  return dl;
}

function table(id, columns, rows) {
  const head = el("tr", {}, ...columns.map(([name, right]) => el("th", { class: right ? "num" : "", text: name })));
  const body = el("tbody");
  for (const row of rows) {
    body.append(el("tr", {}, ...row.map((cell, i) => el("td", { class: columns[i][1] ? "num" : "", text: cell }))));
  }
  return el("table", { id }, el("thead", {}, head), body);
}

function summaryRow(name, doc) {
  const canvas = el("canvas", { class: "hist" });
  requestAnimationFrame(() => Plot.histogram(canvas, { counts: doc.histogram.counts }));
  const tr = el("tr", {});
  for (const cell of [name, doc.count, num(doc.mean), num(doc.std), num(doc.min), num(doc.max)]) {
    tr.append(el("td", { class: typeof cell === "string" && cell === name ? "" : "num", text: String(cell) }));
  }
  tr.append(el("td", {}, canvas));
  return tr;
}

async function statsPage(readFiles) {
  mark("nav-stats");
  show(el("p", { class: "note", text: readFiles ? "reading the trajectory files…" : "reading the index…" }));
  const doc = await api(`/api/stats?files=${readFiles ? 1 : 0}`);
  const idx = doc.index;
  const nodes = [el("h2", { text: "Checkpoint" })];
  nodes.push(
    facts([
      ["path", doc.path],
      ["format", `${idx.trajectory_format}, seed ${idx.seed ?? "none"}`],
      ["trajectories", `${idx.size} (ids ${idx.id_min ?? "-"} to ${idx.id_max ?? "-"}, counter ${idx.trajectory_counter})`],
      ["samples", String(idx.total_samples)],
      ["window", `${doc.window.trajectories} trajectories, ${doc.window.samples} samples (last ${doc.window.requested})`],
      ["model_weights_ids", String(idx.model_weights_ids)],
    ]),
  );
  if (doc.schema) {
    nodes.push(el("h2", { text: "Schema" }));
    nodes.push(
      table(
        "schema",
        [["field"], ["dtype"], ["per sample"], ["extra rows"], ["trajectories", true], ["bytes", true]],
        doc.schema.map((r) => [
          r.field,
          r.dtype,
          r.per_sample_shape === null ? "(1-dim, not sampled)" : JSON.stringify(r.per_sample_shape),
          r.extra_rows.join(","),
          String(r.trajectories),
          String(r.bytes),
        ]),
      ),
    );
  }
  const data = doc.data;
  if (data) {
    nodes.push(el("h2", { text: "Data" }));
    const body = el("tbody");
    if (data.rewards) body.append(summaryRow("reward", data.rewards));
    if (data.episodes) {
      body.append(summaryRow("episode length", data.episodes.length));
      body.append(summaryRow("episode return", data.episodes.return));
    }
    if (data.versions) body.append(summaryRow("staleness", data.versions.staleness_summary));
    const head = el("tr", {}, ...["", "count", "mean", "std", "min", "max", "histogram"].map((n) => el("th", { text: n })));
    nodes.push(el("table", { id: "data" }, el("thead", {}, head), body));
    if (data.episodes) {
      const e = data.episodes;
      nodes.push(el("p", { text: `episodes: ${e.finished} finished (${e.terminated} terminated, ${e.truncated} truncated, ${e.other} other), ${e.open} open at a trajectory's end` }));
    }
    if (data.versions) {
      nodes.push(el("h2", { text: "Policy versions (samples)" }));
      nodes.push(table("versions", [["version", true], ["samples", true]], data.versions.values.map((v) => [num(v.version), String(v.samples)])));
    }
  } else {
    nodes.push(
      el("p", {}, el("button", { id: "read-files", text: "read the trajectory files", onclick: () => route("#/stats/files") }),
        " for the schema, rewards, episodes and policy versions (reads the small per-step fields of every file)."),
    );
  }
  nodes.push(el("h2", { text: "model_weights_ids" }));
  nodes.push(
    table(
      "weights",
      [["model_weights_id"], ["trajectories", true], ["samples", true], ["in window", true], ["ids"]],
      doc.model_weights.map((g) => [g.model_weights_id || "(empty)", String(g.trajectories), String(g.samples), String(g.window_samples), g.first_id === g.last_id ? String(g.first_id) : `${g.first_id}-${g.last_id}`]),
    ),
  );
  if (doc.model_weights_left_out) nodes.push(el("p", { class: "note", text: `… ${doc.model_weights_left_out} more` }));
  const draws = doc.draws;
  if (draws) {
    nodes.push(el("h2", { text: `Draw spread: ${draws.n} uniform draws (seed ${draws.seed})` }));
    const canvas = el("canvas", { class: "draws", id: "draws" });
    nodes.push(canvas);
    const c = draws.concentration;
    nodes.push(
      el("p", {
        text: `observed (bars) against expected (lines) share per trajectory of the window · total variation ${num(draws.total_variation)} · ` +
          `half the draws on ${c.samples_holding_half_of_draws} samples (expected ${c.samples_holding_half_of_probability})` +
          (c.concentrated ? " · CONCENTRATED" : ""),
      }),
    );
    if (draws.trajectories_left_out) nodes.push(el("p", { class: "note", text: `the first ${draws.trajectories.id.length} trajectories shown, ${draws.trajectories_left_out} more` }));
    requestAnimationFrame(() => Plot.shares(canvas, draws.trajectories));
  }
  show(...nodes);
}

// ------------------------------------------------------------------ routing
async function route(hash) {
  if (hash !== undefined && location.hash !== hash) {
    location.hash = hash; // the hashchange event routes
    return;
  }
  stopPage();
  stopPage = () => {};
  const where = location.hash || "#/";
  try {
    let found;
    if ((found = where.match(/^#\/t\/(\d+)$/))) await trajectoryPage(Number(found[1]));
    else if (where === "#/stats") await statsPage(false);
    else if (where === "#/stats/files") await statsPage(true);
    else if ((found = where.match(/^#\/page\/(\d+)$/))) await listPage(Number(found[1]));
    else await listPage(0);
  } catch (error) {
    failed(error);
  }
}

window.addEventListener("hashchange", () => route());
api("/api/checkpoint")
  .then((doc) => {
    document.getElementById("path").textContent = `${doc.path} · ${doc.trajectories} trajectories, ${doc.samples} samples`;
  })
  .catch(() => {});
route();
