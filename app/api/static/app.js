// ragblend's page. It talks only to the public API (/health, /v1/query, /v1/documents, /v1/cache) and keeps
// no logic of its own beyond drawing what the API returns. No build step, no library.
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);
const KEY_STORAGE = "ragblend.apiKey"; // sessionStorage only: gone when the tab closes
const VIEWS = ["ask", "compare", "explain", "documents"];
const RUN_LABELS = { ask: "Ask", compare: "Compare blend vs full", explain: "Explain" };

// ---- the API -----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(message, status = 0, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function apiHeaders(extra = {}) {
  const headers = { ...extra };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

// fetch with the key; a non-2xx answer or a network failure becomes an ApiError with a readable message.
async function api(path, options = {}) {
  let response;
  try {
    response = await fetch(path, { ...options, headers: apiHeaders(options.headers) });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(`Lost connection to the server (${err.message}).`, 0, "network");
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

// The server's OpenAI-shaped body {"error": {"message", "code", ...}}, else the status line.
async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`.trim();
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) ({ message, code } = body.error);
  } catch { /* not JSON: keep the status line */ }
  const retry = response.headers.get("Retry-After") ? `; retry in ${response.headers.get("Retry-After")} s` : "";
  const hint = {
    401: "enter the API key at the top of the page",
    429: `the server is busy${retry}`,
    503: `the server is not ready${retry}`,
  }[response.status];
  return new ApiError(`Error ${response.status}: ${message}${hint ? ` — ${hint}.` : ""}`, response.status, code);
}

// Server-sent events, parsed as they arrive ("event:" / "data:" lines, a blank line ends one).
class SSEParser {
  constructor(onEvent) {
    this.onEvent = onEvent;
    this.rest = "";
    this.event = "message";
    this.data = [];
  }

  push(text) {
    const all = this.rest + text;
    const cut = all.endsWith("\r") ? all.length - 1 : all.length; // "\r" may be half of "\r\n"
    const lines = all.slice(0, cut).split(/\r\n|\n|\r/);
    this.rest = lines.pop() + all.slice(cut);
    for (const line of lines) this.line(line);
  }

  line(line) {
    if (line === "") {
      if (this.data.length) this.onEvent(this.event, this.data.join("\n"));
      this.event = "message";
      this.data = [];
    } else if (!line.startsWith(":")) { // ":" starts a comment (keep-alive pings)
      const at = line.indexOf(":");
      const field = at < 0 ? line : line.slice(0, at);
      const value = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
      if (field === "event") this.event = value;
      else if (field === "data") this.data.push(value);
    }
  }
}

// POST /v1/query with stream: true; calls onDelta(text) per piece, resolves with the final response.
async function streamQuery(body, onDelta, signal) {
  const response = await api("/v1/query", {
    method: "POST", signal,
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify({ ...body, stream: true }),
  });
  let result = null;
  let failure = null;
  const parser = new SSEParser((event, data) => {
    if (event === "delta") onDelta(JSON.parse(data).delta);
    else if (event === "result") result = JSON.parse(data);
    else if (event === "error") {
      const error = JSON.parse(data).error || {};
      failure = new ApiError(`Error: ${error.message || "the server failed while answering"}`, 500, error.code);
    }
  });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError("Lost connection to the server while the answer was streaming.", 0, "network");
    }
    if (chunk.done) break;
    parser.push(decoder.decode(chunk.value, { stream: true }));
    if (failure) throw failure;
  }
  parser.push("\n\n");
  if (failure) throw failure;
  if (!result) throw new ApiError("The connection closed before the answer was complete.", 0, "incomplete");
  return result;
}

// ---- small helpers -----------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

const ms = (value) => (value === undefined || value === null ? "–" : `${Math.round(value)} ms`);

function showError(err) {
  const box = $("#error");
  if (!err) {
    box.hidden = true;
    box.textContent = "";
    return;
  }
  box.textContent = err.name === "AbortError" ? "Stopped." : err.message || String(err);
  box.hidden = false;
  if (err.status === 401) $("#api-key").focus();
}

// Runs `work` with the form marked busy; every path out clears it (no stuck spinner).
let running = null;
async function busy(label, work) {
  showError(null);
  const controller = new AbortController();
  running = controller;
  $("#run").disabled = true;
  $("#stop").hidden = false;
  $("#busy").textContent = label;
  document.body.classList.add("is-busy");
  try {
    await work(controller.signal);
  } catch (err) {
    showError(err);
  } finally {
    running = null;
    $("#run").disabled = false;
    $("#stop").hidden = true;
    $("#busy").textContent = "";
    document.body.classList.remove("is-busy");
  }
}

// ---- the query form ----------------------------------------------------------------------------

function queryBody() {
  const body = { question: $("#question").value, mode: $("#mode").value };
  const number = (id) => ($(id).value.trim() === "" ? null : Number($(id).value));
  const ratio = number("#ratio"), topK = number("#top-k"), maxTokens = number("#max-tokens");
  if (ratio !== null) body.recompute_ratio = ratio;
  if (topK !== null) body.top_k = topK;
  if (maxTokens !== null) body.max_tokens = maxTokens;
  return body;
}

function currentView() {
  const name = location.hash.slice(1);
  return VIEWS.includes(name) ? name : "ask";
}

async function runQuery() {
  const view = currentView() === "documents" ? "ask" : currentView();
  if (!$("#question").value.trim()) {
    showError(new Error("Type a question first."));
    $("#question").focus();
    return;
  }
  if (view === "compare") return busy("Comparing…", compare);
  if (view === "explain") return busy("Explaining…", explain);
  return busy("Answering…", ask);
}

// ---- Ask ---------------------------------------------------------------------------------------

async function ask(signal) {
  const answer = $("#answer");
  answer.textContent = "";
  answer.classList.add("streaming");
  $("#sources").replaceChildren();
  $("#stats").replaceChildren();
  try {
    const result = await streamQuery(queryBody(), (delta) => { answer.textContent += delta; }, signal);
    answer.textContent = result.answer;
    renderSources($("#sources"), result.sources);
    renderStats($("#stats"), result.stats, result.finish_reason);
  } finally {
    answer.classList.remove("streaming");
  }
}

function renderSources(list, sources) {
  list.replaceChildren(...sources.map((s) => el("li", { class: "source" },
    el("details", {},
      el("summary", {},
        el("span", { class: "score", text: s.score.toFixed(3) }), " ",
        el("strong", { text: s.doc_id }), s.title ? ` — ${s.title}` : "",
        el("span", { class: "muted", text: ` (chunk ${s.chunk_id})` })),
      el("p", { class: "chunk-text", text: s.text })))));
  if (!sources.length) list.append(el("li", { class: "muted", text: "No passages retrieved (is anything ingested?)" }));
}

function renderStats(list, stats, finishReason) {
  const tiers = Object.entries(stats.store_hits || {}).map(([tier, n]) => `${tier}: ${n}`).join(", ");
  const rows = [
    ["mode", "Mode", stats.mode],
    ["ttft_ms", "Time to first token", ms(stats.ttft_ms)],
    ["total_ms", "Total", ms(stats.total_ms)],
    ["queue_ms", "Queued", ms(stats.queue_ms)],
    ["prefill_ms", "Prefill", ms(stats.prefill_ms)],
    ["prompt_tokens", "Prompt tokens", stats.prompt_tokens],
    ["cached_tokens", "Cached tokens", stats.cached_tokens],
    ["recomputed_tokens", "Recomputed tokens", stats.recomputed_tokens],
    ["completion_tokens", "Answer tokens", `${stats.completion_tokens}${finishReason === "length" ? " (hit max tokens)" : ""}`],
    ["store_hits", "Store hits per tier", tiers || "–"],
  ];
  if (stats.fallback) rows.push(["fallback", "Ran in full because", stats.fallback]);
  list.replaceChildren(...rows.flatMap(([key, label, value]) =>
    [el("dt", { text: label }), el("dd", { "data-stat": key, text: String(value) })]));
}

// ---- Compare -----------------------------------------------------------------------------------

async function compare(signal) {
  const base = queryBody();
  const columns = { blend: $("#compare-blend"), full: $("#compare-full") };
  const verdict = $("#compare-verdict");
  verdict.textContent = "";
  verdict.className = "verdict";
  for (const column of Object.values(columns)) {
    column.classList.remove("differs", "same");
    for (const field of column.querySelectorAll("[data-field]")) field.textContent = field.tagName === "OUTPUT" ? "–" : "";
  }
  // One after the other: the server runs one model call at a time, so each TTFT is its own.
  const results = {};
  for (const mode of ["blend", "full"]) {
    const column = columns[mode];
    const answer = $("[data-field=answer]", column);
    answer.classList.add("streaming");
    try {
      results[mode] = await streamQuery({ ...base, mode }, (delta) => { answer.textContent += delta; }, signal);
    } finally {
      answer.classList.remove("streaming");
    }
    const s = results[mode].stats;
    answer.textContent = results[mode].answer;
    $("[data-field=ttft]", column).textContent = ms(s.ttft_ms);
    $("[data-field=meta]", column).textContent =
      `${s.prompt_tokens} prompt tokens, ${s.cached_tokens} cached, ${s.recomputed_tokens} recomputed; total ${ms(s.total_ms)}`;
  }
  const speedup = results.full.stats.ttft_ms / Math.max(results.blend.stats.ttft_ms, 0.001);
  const same = normalize(results.blend.answer) === normalize(results.full.answer);
  markDifferences(columns, results, same);
  verdict.classList.add(same ? "same" : "differs");
  verdict.textContent = `Blended TTFT is ${speedup.toFixed(2)}× ${speedup >= 1 ? "faster" : "slower"} than full prefill` +
    ` (${ms(results.blend.stats.ttft_ms)} vs ${ms(results.full.stats.ttft_ms)}). ` +
    (same ? "Same answer." : "The answers differ (differing words marked).");
  verdict.dataset.speedup = speedup.toFixed(3);
}

const normalize = (text) => text.trim().replace(/\s+/g, " ");

// Marks the words of each answer that the other lacks (a longest-common-subsequence diff).
function markDifferences(columns, results, same) {
  for (const mode of ["blend", "full"]) columns[mode].classList.add(same ? "same" : "differs");
  if (same) return;
  const a = normalize(results.blend.answer).split(" "), b = normalize(results.full.answer).split(" ");
  const [keepA, keepB] = commonWords(a, b);
  for (const [mode, words, keep] of [["blend", a, keepA], ["full", b, keepB]]) {
    const answer = $("[data-field=answer]", columns[mode]);
    answer.replaceChildren(...words.flatMap((word, i) =>
      [keep[i] ? word : el("mark", { class: "diff", text: word }), i < words.length - 1 ? " " : ""]));
  }
}

function commonWords(a, b) {
  const table = Array.from({ length: a.length + 1 }, () => new Array(b.length + 1).fill(0));
  for (let i = a.length - 1; i >= 0; i--)
    for (let j = b.length - 1; j >= 0; j--)
      table[i][j] = a[i] === b[j] ? table[i + 1][j + 1] + 1 : Math.max(table[i + 1][j], table[i][j + 1]);
  const keepA = new Array(a.length).fill(false), keepB = new Array(b.length).fill(false);
  for (let i = 0, j = 0; i < a.length && j < b.length;) {
    if (a[i] === b[j]) { keepA[i++] = true; keepB[j++] = true; }
    else if (table[i + 1][j] >= table[i][j + 1]) i++;
    else j++;
  }
  return [keepA, keepB];
}

// ---- Explain -----------------------------------------------------------------------------------

let explained = null; // the last response's explain part and its token spans

async function explain(signal) {
  const answer = $("#explain-answer");
  answer.textContent = "";
  $("#explain-summary").textContent = "";
  $("#prompt-map").replaceChildren();
  const result = await streamQuery({ ...queryBody(), explain: true }, (delta) => { answer.textContent += delta; }, signal);
  answer.textContent = `Answer: ${result.answer}`;
  drawPrompt(result);
}

function drawPrompt(result) {
  const x = result.explain, stats = result.stats;
  const scored = x.tokens.map((t) => t.score).filter((s) => s !== null);
  const heat = heatScale(scored);
  const spans = [];
  const blocks = x.chunks.map((chunk, index) => {
    const tokens = el("div", { class: "tokens" });
    const block = el("section", { class: `chunk kind-${chunk.kind}`, "data-chunk": index },
      el("h3", { class: "chunk-title", text: chunkTitle(chunk, index, result) }), tokens);
    block.tokens = tokens;
    return block;
  });
  x.tokens.forEach((token, i) => {
    const classes = ["tok"];
    if (token.selected) classes.push("sel");
    if (i < x.exact_tokens) classes.push("exact");
    if (i >= x.cached_tokens) classes.push("fresh");
    const span = el("span", { class: classes.join(" "), "data-i": i, title: tokenLabel(x, i, result) },
      token.text === "\n" ? "↵\n" : token.text);
    if (token.score !== null) span.style.setProperty("--heat", heat(token.score).toFixed(3));
    blocks[token.chunk].tokens.append(span);
    spans.push(span);
  });
  const map = $("#prompt-map");
  map.replaceChildren(...blocks);
  explained = { x, result, spans, cursor: -1 };
  const shown = spans.filter((s) => s.classList.contains("sel")).length;
  $("#explain-summary").replaceChildren(
    `${x.prompt_tokens} prompt tokens: ${x.exact_tokens} exact prefix, ${x.cached_tokens} from the store, `,
    el("strong", { "data-stat": "recomputed_tokens", text: String(stats.recomputed_tokens) }),
    ` recomputed (${stats.mode}, ratio ${stats.recompute_ratio}); ${shown} highlighted. Score: ${x.score}.`,
    x.truncated ? el("span", { class: "warn", text: ` Showing the first ${x.tokens.length} of ${x.prompt_tokens} tokens.` }) : "");
}

function chunkTitle(chunk, index, result) {
  const size = `${chunk.end - chunk.start} tokens, ${chunk.recomputed} recomputed`;
  if (chunk.kind === "head") return `Prompt head · ${size}`;
  if (chunk.kind === "question") return `Question · ${chunk.end - chunk.start} tokens, always computed`;
  const source = result.sources[chunk.source];
  const name = source ? `${source.doc_id}${source.title ? ` — ${source.title}` : ""}` : "passage";
  return `Passage ${chunk.source + 1}: ${name} · ${size}`;
}

function tokenLabel(x, i, result) {
  const token = x.tokens[i];
  const parts = [JSON.stringify(token.text), `position ${i}`];
  parts.push(token.score === null ? "not scored" : `score ${token.score}`);
  if (i < x.exact_tokens) parts.push("exact prefix");
  else if (i >= x.cached_tokens) parts.push(result.stats.mode === "full" ? "computed (full prefill)" : "question, computed");
  else parts.push(token.selected ? "recomputed" : "reused from the store");
  return parts.join(" · ");
}

// Scores span orders of magnitude: colour by log score, 0..1 over this prompt's range.
function heatScale(scores) {
  if (!scores.length) return () => 0;
  const logs = scores.map((s) => Math.log10(s + 1e-9));
  const lo = Math.min(...logs), hi = Math.max(...logs);
  return (score) => (hi > lo ? (Math.log10(score + 1e-9) - lo) / (hi - lo) : 1);
}

function pointAt(i) {
  if (!explained || !explained.spans.length) return;
  const { spans } = explained;
  i = Math.max(0, Math.min(spans.length - 1, i));
  if (explained.cursor >= 0) spans[explained.cursor].classList.remove("cur");
  explained.cursor = i;
  spans[i].classList.add("cur");
  $("#token-info").textContent = spans[i].title;
}

function onPromptKey(event) {
  if (!explained) return;
  const step = { ArrowRight: 1, ArrowDown: 10, ArrowLeft: -1, ArrowUp: -10 }[event.key];
  if (step) pointAt(explained.cursor + step);
  else if (event.key === "Home") pointAt(0);
  else if (event.key === "End") pointAt(explained.spans.length - 1);
  else return;
  event.preventDefault();
  explained.spans[explained.cursor].scrollIntoView({ block: "nearest" });
}

// ---- Documents ---------------------------------------------------------------------------------

async function loadDocuments() {
  const body = $("#documents tbody");
  try {
    const list = await (await api("/v1/documents")).json();
    body.replaceChildren(...list.data.map(documentRow));
    if (!list.data.length) body.append(el("tr", {}, el("td", { colspan: 6, class: "muted", text: "No documents yet: upload one above." })));
  } catch (err) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 6, class: "muted", text: "Could not load the documents." })));
    showError(err);
  }
}

// The KV cache's figures (GET /v1/cache): per tier, and the lease families pinning the most.
async function loadCache() {
  const tiers = $("#cache-tiers tbody");
  const families = $("#cache-families tbody");
  try {
    const cache = await (await api("/v1/cache")).json();
    $("#cache-summary").textContent = `Hit rate ${percent(cache.hit_rate)} · ${cache.leases} lease${cache.leases === 1 ? "" : "s"} `
      + `in ${cache.families} famil${cache.families === 1 ? "y" : "ies"} holding ${cache.leased_entries} entr${cache.leased_entries === 1 ? "y" : "ies"}`;
    tiers.replaceChildren(...Object.entries(cache.tiers).map(([name, t]) => el("tr", { "data-tier": name },
      el("th", { scope: "row", text: name }), el("td", { text: count(t.entries) }),
      el("td", { text: bytes(t.bytes) + (t.capacity ? ` of ${bytes(t.capacity)}` : "") }),
      el("td", { text: `${bytes(t.pinned_bytes)} (${bytes(t.pinned_cap)})` }), el("td", { text: percent(t.hit_rate) }),
      el("td", { text: count(t.evictions) }), el("td", { text: count(t.lease_held) }))));
    families.replaceChildren(...cache.data.map((f) => el("tr", { "data-family": f.family },
      el("td", { class: "mono", text: f.family.slice(0, 12), title: f.family }), el("td", { text: String(f.entries) }),
      el("td", { text: Object.entries(f.pinned_bytes).map(([tier, n]) => `${tier} ${bytes(n)}`).join(", ") }),
      el("td", { class: "muted", text: new Date(f.expires_at * 1000).toLocaleString() }))));
    if (!cache.data.length) families.append(el("tr", {}, el("td", { colspan: 4, class: "muted", text: "No leases." })));
  } catch (err) {
    $("#cache-summary").textContent = "Could not load the cache figures.";
    tiers.replaceChildren();
    families.replaceChildren();
    showError(err);
  }
}

const count = (n) => (n === null || n === undefined ? "–" : n.toLocaleString());
const percent = (rate) => (rate === null || rate === undefined ? "–" : `${(rate * 100).toFixed(1)} %`);

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function documentRow(doc) {
  const remove = el("button", { type: "button", class: "quiet", "aria-label": `Delete ${doc.id}`, text: "Delete" });
  remove.addEventListener("click", () => deleteDocument(doc.id, remove));
  return el("tr", { "data-doc": doc.id },
    el("td", { text: doc.id }), el("td", { text: doc.title || "" }), el("td", { text: String(doc.n_chunks) }),
    el("td", { class: "muted", text: doc.source || "" }),
    el("td", { class: "muted", text: new Date(doc.ingested_at * 1000).toLocaleString() }), el("td", {}, remove));
}

async function deleteDocument(id, button) {
  if (!window.confirm(`Delete ${id}? Its chunks and cached KV go too.`)) return;
  button.disabled = true;
  showError(null);
  try {
    await api(`/v1/documents/${encodeURIComponent(id)}`, { method: "DELETE" });
    $("#upload-result").textContent = `Deleted ${id}.`;
  } catch (err) {
    showError(err);
  } finally {
    button.disabled = false;
    await loadDocuments();
  }
}

async function upload(event) {
  event.preventDefault();
  const file = $("#upload-file").files[0];
  const result = $("#upload-result");
  showError(null);
  if (!file) {
    showError(new Error("Choose a .txt, .md or .jsonl file first."));
    return;
  }
  const form = new FormData();
  form.append("file", file);
  if ($("#upload-id").value.trim()) form.append("id", $("#upload-id").value.trim());
  if ($("#upload-title").value.trim()) form.append("title", $("#upload-title").value.trim());
  const button = $("button[type=submit]", $("#upload-form"));
  button.disabled = true;
  result.textContent = `Uploading ${file.name}…`;
  try {
    const url = $("#upload-replace").checked ? "/v1/documents?replace=true" : "/v1/documents";
    const response = await (await api(url, { method: "POST", body: form })).json();
    result.textContent = response.data.map((d) => `${d.id}: ${d.status} (${d.n_chunks} chunk${d.n_chunks === 1 ? "" : "s"})`).join("; ");
    $("#upload-form").reset();
  } catch (err) {
    result.textContent = "";
    showError(err);
  } finally {
    button.disabled = false;
    await loadDocuments();
  }
}

// ---- the page ----------------------------------------------------------------------------------

function showView() {
  const view = currentView();
  for (const name of VIEWS) $(`#view-${name}`).hidden = name !== view;
  for (const tab of document.querySelectorAll(".tabs a")) {
    if (tab.dataset.view === view) tab.setAttribute("aria-current", "page");
    else tab.removeAttribute("aria-current");
  }
  $("#query-form").hidden = view === "documents";
  $("#mode-field").hidden = view === "compare"; // compare always runs blend, then full
  $("#run").textContent = RUN_LABELS[view] || "Ask";
  if (view === "documents") loadDocuments().then(loadCache);
}

async function checkHealth() {
  const status = $("#health");
  try {
    const response = await fetch("/health");
    const body = await response.json();
    if (response.ok) {
      status.textContent = `${body.model} ready`;
      status.className = "health ok";
      return;
    }
    status.textContent = body.status === "error" ? `model failed to load: ${body.error.message}` : "model loading…";
    status.className = "health warn";
    if (body.status !== "error") setTimeout(checkHealth, 3000);
  } catch {
    status.textContent = "server unreachable";
    status.className = "health warn";
    setTimeout(checkHealth, 5000);
  }
}

function setupKey() {
  const input = $("#api-key");
  input.value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("#key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = input.value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    showError(null);
    $("#health").textContent = key ? "key set for this tab" : "no key";
    if (currentView() === "documents") loadDocuments();
    setTimeout(checkHealth, 800);
  });
  $("#key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    input.value = "";
    $("#health").textContent = "key forgotten";
  });
}

function setup() {
  setupKey();
  $("#query-form").addEventListener("submit", (event) => {
    event.preventDefault();
    if (!running) runQuery();
  });
  $("#question").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("#query-form").requestSubmit();
    }
  });
  $("#stop").addEventListener("click", () => running && running.abort());
  $("#upload-form").addEventListener("submit", upload);
  $("#documents-refresh").addEventListener("click", () => loadDocuments().then(loadCache));
  const map = $("#prompt-map");
  map.addEventListener("keydown", onPromptKey);
  map.addEventListener("mouseover", (event) => {
    const span = event.target.closest(".tok");
    if (span && explained) pointAt(Number(span.dataset.i));
  });
  window.addEventListener("hashchange", showView);
  showView();
  checkHealth();
}

setup();
