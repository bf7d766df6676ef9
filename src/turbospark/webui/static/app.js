// The chat page: talks to this server's OpenAI chat completions API (streaming), keeps
// conversations in localStorage and an API key in sessionStorage. Model output is rendered by
// markdown-it with raw HTML off (escaped) and images off; everything else the page writes goes
// in as text (textContent), never as HTML.
"use strict";

const STORE = {
  conversations: "turbospark.conversations",
  current: "turbospark.current",
  settings: "turbospark.settings",
  model: "turbospark.model",
  key: "turbospark.apiKey", // sessionStorage: this tab only
};

const $ = (id) => document.getElementById(id);

function element(tag, props = {}, children = []) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "text") el.textContent = value;
    else if (name === "class") el.className = value;
    else el.setAttribute(name, value);
  }
  el.append(...children);
  return el;
}

// ---- Markdown ---------------------------------------------------------------------------

const md = window.markdownit({ html: false, linkify: true });
md.disable(["image"]); // no request from a reply: a picture in Markdown stays text
const renderToken = (tokens, idx, options, env, self) => self.renderToken(tokens, idx, options);
const linkOpen = md.renderer.rules.link_open || renderToken;
md.renderer.rules.link_open = (tokens, idx, options, env, self) => {
  tokens[idx].attrSet("target", "_blank");
  tokens[idx].attrSet("rel", "noopener noreferrer");
  return linkOpen(tokens, idx, options, env, self);
};
for (const rule of ["fence", "code_block"]) {
  const base = md.renderer.rules[rule];
  md.renderer.rules[rule] = (tokens, idx, options, env, self) =>
    '<div class="code"><button type="button" class="copy">Copy</button>' +
    base(tokens, idx, options, env, self) +
    "</div>";
}

// ---- Storage ----------------------------------------------------------------------------

function loadJSON(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

let conversations = loadJSON(STORE.conversations, []);
let currentId = localStorage.getItem(STORE.current);
const settings = Object.assign({ system: "", temperature: "", maxTokens: "" }, loadJSON(STORE.settings, {}));
let pendingImages = []; // [{name, url}] attached to the next message
let running = null; // {controller, conversation, message}

function save() {
  try {
    localStorage.setItem(STORE.conversations, JSON.stringify(conversations));
    localStorage.setItem(STORE.current, currentId || "");
    localStorage.setItem(STORE.settings, JSON.stringify(settings));
  } catch (err) {
    notice(`Could not save the conversations in this browser: ${err.message}`);
  }
}

function apiKey() {
  return sessionStorage.getItem(STORE.key) || "";
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h.Authorization = `Bearer ${apiKey()}`;
  return h;
}

function notice(text) {
  const box = $("notice");
  box.textContent = text || "";
  box.hidden = !text;
}

// ---- Conversations ----------------------------------------------------------------------

function current() {
  return conversations.find((c) => c.id === currentId) || null;
}

function newConversation() {
  const now = Date.now();
  const conv = { id: `c${now.toString(36)}${Math.random().toString(36).slice(2, 8)}`, title: "New chat", created: now, updated: now, model: $("model").value, messages: [] };
  conversations.unshift(conv);
  currentId = conv.id;
  save();
  return conv;
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  const sorted = [...conversations].sort((a, b) => b.updated - a.updated);
  for (const conv of sorted) {
    const open = element("button", { type: "button", class: "open", text: conv.title, title: conv.title });
    const rename = element("button", { type: "button", class: "rename", title: "Rename", text: "Rename" });
    const remove = element("button", { type: "button", class: "delete", title: "Delete", text: "Delete" });
    const item = element("li", { class: conv.id === currentId ? "conv current" : "conv" }, [open, rename, remove]);
    item.dataset.id = conv.id;
    open.addEventListener("click", () => select(conv.id));
    rename.addEventListener("click", () => startRename(item, conv));
    remove.addEventListener("click", () => {
      if (running && running.conversation === conv) running.controller.abort();
      conversations = conversations.filter((c) => c !== conv);
      if (currentId === conv.id) currentId = conversations[0]?.id || null;
      save();
      renderAll();
    });
    list.append(item);
  }
}

function startRename(item, conv) {
  const input = element("input", { type: "text", class: "rename-input", "aria-label": "New name" });
  input.value = conv.title;
  const done = (keep) => {
    if (keep && input.value.trim()) {
      conv.title = input.value.trim().slice(0, 200);
      save();
    }
    renderList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") done(true);
    else if (e.key === "Escape") done(false);
  });
  input.addEventListener("blur", () => done(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

function select(id) {
  currentId = id;
  const conv = current();
  if (conv && conv.model && [...$("model").options].some((o) => o.value === conv.model)) {
    $("model").value = conv.model;
    checkVision();
  }
  save();
  renderAll();
}

// ---- Messages ---------------------------------------------------------------------------

function statsText(msg) {
  const parts = [];
  const usage = msg.usage;
  if (usage) {
    parts.push(`${usage.completion_tokens} tokens`);
    if (msg.tokensPerSecond) parts.push(`${msg.tokensPerSecond.toFixed(1)} tokens/s`);
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  if (msg.finish === "length") parts.push("cut at max tokens");
  if (msg.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function messageElement(msg, index, isLast) {
  const parts = {
    reasoning: element("details", { class: "reasoning" }, [element("summary", { text: "Reasoning" })]),
    reasoningBody: element("div", { class: "reasoning-body" }),
    content: element("div", { class: msg.role === "assistant" ? "content markdown" : "content" }),
    tools: element("div", { class: "tool-calls" }),
    error: element("div", { class: "error", role: "alert" }),
    stats: element("div", { class: "stats" }),
  };
  parts.reasoning.append(parts.reasoningBody);
  const label = element("div", { class: "who", text: msg.role === "user" ? "You" : msg.model || "Assistant" });
  const images = element("div", { class: "images" });
  for (const img of msg.images || []) images.append(element("img", { src: img.url, alt: img.name }));
  const actions = element("div", { class: "actions" });
  if (msg.role === "user") {
    const edit = element("button", { type: "button", class: "edit", text: "Edit" });
    edit.addEventListener("click", () => startEdit(index));
    actions.append(edit);
  } else if (isLast) {
    const again = element("button", { type: "button", class: "regenerate", text: "Regenerate" });
    again.addEventListener("click", regenerate);
    actions.append(again);
  }
  const el = element("article", { class: `msg ${msg.role}` }, [
    label,
    images,
    parts.reasoning,
    parts.content,
    parts.tools,
    parts.error,
    parts.stats,
    actions,
  ]);
  el.dataset.index = index;
  el.parts = parts;
  update(el, msg);
  return el;
}

function update(el, msg) {
  const p = el.parts;
  p.reasoning.hidden = !msg.reasoning;
  if (msg.reasoning) p.reasoningBody.innerHTML = md.render(msg.reasoning);
  if (msg.role === "assistant") p.content.innerHTML = md.render(msg.content || "");
  else p.content.textContent = msg.content;
  p.tools.replaceChildren(
    ...(msg.toolCalls || []).map((call) =>
      element("div", { class: "tool-call" }, [
        element("span", { class: "tool-label", text: "tool call" }),
        element("code", { class: "tool-name", text: call.name }),
        element("pre", { class: "tool-args", text: call.arguments }),
      ]),
    ),
  );
  p.error.textContent = msg.error || "";
  p.error.hidden = !msg.error;
  p.stats.textContent = statsText(msg);
}

function renderMessages() {
  const box = $("messages");
  const conv = current();
  const msgs = conv ? conv.messages : [];
  box.replaceChildren(...msgs.map((m, i) => messageElement(m, i, i === msgs.length - 1 && !running)));
  if (running && running.conversation === conv) running.element = box.lastElementChild;
  box.scrollTop = box.scrollHeight;
}

function renderAll() {
  renderList();
  renderMessages();
}

function startEdit(index) {
  if (running) return;
  const conv = current();
  const msg = conv.messages[index];
  const article = $("messages").querySelector(`article[data-index="${index}"]`);
  const area = element("textarea", { class: "edit-input", rows: "4", "aria-label": "Edit message" });
  area.value = msg.content;
  const resend = element("button", { type: "button", class: "resend", text: "Save & send" });
  const cancel = element("button", { type: "button", text: "Cancel" });
  resend.addEventListener("click", () => {
    msg.content = area.value;
    conv.messages.splice(index + 1);
    generate(conv);
  });
  cancel.addEventListener("click", renderMessages);
  article.parts.content.replaceChildren(area, element("div", { class: "edit-buttons" }, [resend, cancel]));
  area.focus();
}

function regenerate() {
  const conv = current();
  if (running || !conv) return;
  while (conv.messages.length && conv.messages.at(-1).role === "assistant") conv.messages.pop();
  if (conv.messages.length) generate(conv);
}

// ---- The API ----------------------------------------------------------------------------

function apiMessages(conv, upTo) {
  const out = [];
  if (settings.system.trim()) out.push({ role: "system", content: settings.system });
  for (const m of conv.messages.slice(0, upTo)) {
    if (m.role === "user") {
      if (m.images && m.images.length) {
        out.push({
          role: "user",
          content: [{ type: "text", text: m.content }, ...m.images.map((i) => ({ type: "image_url", image_url: { url: i.url } }))],
        });
      } else out.push({ role: "user", content: m.content });
    } else if (m.content) out.push({ role: "assistant", content: m.content });
  }
  return out;
}

async function errorText(reply) {
  const text = await reply.text();
  try {
    const body = JSON.parse(text);
    const message = body.error?.message ?? body.error ?? text;
    return typeof message === "string" ? message : JSON.stringify(message);
  } catch {
    return text;
  }
}

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.dataset.state = on ? "streaming" : "idle";
}

async function generate(conv) {
  const model = $("model").value;
  const msg = { role: "assistant", content: "", reasoning: "", toolCalls: [], model };
  const upTo = conv.messages.length;
  conv.messages.push(msg);
  conv.model = model;
  conv.updated = Date.now();
  const controller = new AbortController();
  running = { controller, conversation: conv, message: msg, element: null };
  setRunning(true);
  save();
  renderAll();
  let scheduled = false;
  const redraw = () => {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => {
      scheduled = false;
      const el = running?.message === msg ? running.element : null;
      if (el?.isConnected) update(el, msg); // gone while another conversation is shown
      const box = $("messages");
      box.scrollTop = box.scrollHeight;
    });
  };
  const body = { model, messages: apiMessages(conv, upTo), stream: true, stream_options: { include_usage: true } };
  if (settings.temperature !== "") body.temperature = Number(settings.temperature);
  if (settings.maxTokens !== "") body.max_tokens = Number(settings.maxTokens);
  let first = null;
  let last = null;
  const onFrame = (frame) => {
    const data = frame
      .split("\n")
      .filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(5).trimStart())
      .join("\n");
    if (!data || data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) {
      msg.error = chunk.error.message || JSON.stringify(chunk.error);
      return;
    }
    if (chunk.usage) msg.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.content || delta.reasoning_content || delta.tool_calls) {
        last = performance.now();
        if (first === null) first = last;
      }
      if (delta.content) msg.content += delta.content;
      if (delta.reasoning_content) msg.reasoning += delta.reasoning_content;
      for (const call of delta.tool_calls || []) {
        const slot = (msg.toolCalls[call.index ?? msg.toolCalls.length] ||= { name: "", arguments: "" });
        if (call.function?.name) slot.name += call.function.name;
        if (call.function?.arguments) slot.arguments += call.function.arguments;
      }
      if (choice.finish_reason) msg.finish = choice.finish_reason;
    }
  };
  try {
    const reply = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!reply.ok) {
      const message = await errorText(reply);
      msg.error = reply.status === 401 ? `401 Unauthorized: ${message}` : `Error ${reply.status}: ${message}`;
      if (reply.status === 401) askForKey(message);
      return;
    }
    const reader = reply.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        onFrame(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
      }
      redraw();
    }
  } catch (err) {
    if (err.name === "AbortError") msg.stopped = true;
    else msg.error = `${err.message || err}`;
  } finally {
    const n = msg.usage?.completion_tokens;
    if (n > 1 && last > first) msg.tokensPerSecond = ((n - 1) * 1000) / (last - first);
    if (conv.title === "New chat" && upTo > 0) conv.title = conv.messages[upTo - 1].content.slice(0, 60) || "New chat";
    conv.updated = Date.now();
    running = null;
    setRunning(false);
    save();
    renderAll();
  }
}

async function send() {
  if (running) return;
  const text = $("input").value;
  if (!text.trim() && !pendingImages.length) return;
  if (!$("model").value) {
    notice("No model to send to: the model list did not load.");
    return;
  }
  const conv = current() || newConversation();
  const msg = { role: "user", content: text };
  if (pendingImages.length) msg.images = pendingImages;
  conv.messages.push(msg);
  pendingImages = [];
  renderAttachments();
  $("input").value = "";
  await generate(conv);
}

// ---- Models, key, vision ----------------------------------------------------------------

function askForKey(message) {
  $("key-message").textContent = `This server needs an API key (401: ${message}).`;
  $("key-panel").hidden = false;
  $("api-key").focus();
}

async function loadModels() {
  let reply;
  try {
    reply = await fetch("/v1/models", { headers: headers() });
  } catch (err) {
    notice(`Cannot reach the server: ${err.message}`);
    return;
  }
  if (reply.status === 401) {
    askForKey(await errorText(reply));
    return;
  }
  if (!reply.ok) {
    notice(`The model list failed: ${reply.status} ${await errorText(reply)}`);
    return;
  }
  $("key-panel").hidden = true;
  notice("");
  const names = (await reply.json()).data
    .filter((m) => !m.capabilities || m.capabilities.includes("completion"))
    .map((m) => m.id);
  const select = $("model");
  select.replaceChildren(...names.map((n) => element("option", { value: n, text: n })));
  const wanted = current()?.model || localStorage.getItem(STORE.model);
  if (names.includes(wanted)) select.value = wanted;
  document.body.dataset.models = "loaded";
  checkVision();
}

async function checkVision() {
  const model = $("model").value;
  if (!model) return;
  let vision = false;
  try {
    const reply = await fetch("/api/show", { method: "POST", headers: headers(), body: JSON.stringify({ model }) });
    if (reply.ok) vision = ((await reply.json()).capabilities || []).includes("vision");
  } catch {
    // the hint only
  }
  $("vision-hint").textContent = vision ? "reads images" : "no vision: the server refuses images";
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren(
    ...pendingImages.map((img, i) => {
      const remove = element("button", { type: "button", title: "Remove", text: "×" });
      remove.addEventListener("click", () => {
        pendingImages.splice(i, 1);
        renderAttachments();
      });
      return element("span", { class: "attachment" }, [element("img", { src: img.url, alt: img.name }), remove]);
    }),
  );
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// ---- Wiring -----------------------------------------------------------------------------

function exportConversation() {
  const conv = current();
  if (!conv) return;
  const blob = new Blob([JSON.stringify(conv, null, 2)], { type: "application/json" });
  const url = URL.createObjectURL(blob);
  const link = element("a", { href: url, download: `${conv.title.replace(/[^\w.-]+/g, "_") || "chat"}.json` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => running && running.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (running) return;
    currentId = null;
    save();
    renderAll();
    $("input").focus();
  });
  $("export").addEventListener("click", exportConversation);
  $("model").addEventListener("change", () => {
    localStorage.setItem(STORE.model, $("model").value);
    checkVision();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(STORE.key, $("api-key").value.trim());
    $("api-key").value = "";
    loadModels();
  });
  $("attach").addEventListener("change", async (e) => {
    for (const file of e.target.files) pendingImages.push({ name: file.name, url: await readAsDataURL(file) });
    e.target.value = "";
    renderAttachments();
  });
  for (const [id, key] of [["system", "system"], ["temperature", "temperature"], ["max-tokens", "maxTokens"]]) {
    $(id).value = settings[key];
    $(id).addEventListener("input", () => {
      settings[key] = $(id).value;
      save();
    });
  }
  $("messages").addEventListener("click", (e) => {
    const button = e.target.closest("button.copy");
    if (!button) return;
    const code = button.parentElement.querySelector("pre");
    navigator.clipboard.writeText(code ? code.textContent : "").then(
      () => (button.textContent = "Copied"),
      () => (button.textContent = "Copy failed"),
    );
    setTimeout(() => (button.textContent = "Copy"), 1500);
  });
}

wire();
setRunning(false);
renderAll();
loadModels();
