// The vidpipe dashboard: polls /v1/sources and /v1/stats every second and shows each
// source's state, rate, latency, drops and latest annotated snapshot.
//
// With a token, open /?token=...: it is kept in sessionStorage (and removed from the
// address bar) and sent as "Authorization: Bearer" on every call; snapshots are then
// fetched with that header and shown through blob: URLs, since <img src> cannot send it.
"use strict";

const POLL_MS = 1000;

const token = (() => {
  const params = new URLSearchParams(location.search);
  const fromUrl = params.get("token");
  if (fromUrl) {
    sessionStorage.setItem("vidpipe-token", fromUrl);
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
  }
  return sessionStorage.getItem("vidpipe-token");
})();

const authHeaders = token ? { Authorization: "Bearer " + token } : {};
const cards = new Map(); // source id -> {root, img, fields, shownPublished, loading, blobUrl}

async function getJson(path) {
  const resp = await fetch(path, { headers: authHeaders, cache: "no-store" });
  if (resp.status === 401) {
    throw new Error(token ? "the token was refused" : "a token is required: open /?token=<token>");
  }
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

function fmt(value, digits = 1) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function makeCard(id) {
  const root = el("article", { class: "card", "data-source-id": id });
  const title = el("h3");
  title.append(el("span", { class: "id" }, id), el("span", { class: "state" }));
  const reason = el("div", { class: "reason" });
  // Set while the source cannot keep up: the same text as the WARNING in the log.
  const overload = el("div", { class: "overload", role: "status", hidden: "" });
  const dl = el("dl");
  const fields = { title, reason, overload };
  for (const [key, label] of [
    ["fps", "fps"], ["p50", "p50 ms"], ["p99", "p99 ms"],
    ["published", "published"], ["dropped", "dropped"], ["queue", "queue"],
  ]) {
    const wrap = el("div");
    const dd = el("dd", { "data-field": key }, "–");
    wrap.append(el("dt", {}, label), dd);
    dl.append(wrap);
    fields[key] = dd;
  }
  const img = el("img", { alt: `latest frame of ${id}`, id: `snapshot-${id}` });
  const video = el("video", { id: `live-${id}`, muted: "", playsinline: "", hidden: "" });
  video.muted = true;
  const live = el("button", { type: "button", class: "live", "data-live": id }, "Watch live");
  // Why the live view could not start or was lost. Its own element, not the page's status
  // line, which every poll rewrites: it stays until the user clicks the button again.
  const liveError = el("div", { class: "live-error", role: "alert", "data-live-error": id, hidden: "" });
  const card = {
    root, img, video, live, liveError, fields, shownPublished: 0, loading: false, blobUrl: null, whep: null,
  };
  live.addEventListener("click", () => (card.whep ? stopLive(card) : startLive(id, card)));
  root.append(title, reason, overload, dl, img, video, live, liveError);
  return card;
}

function showLiveError(card, message) {
  card.liveError.textContent = message;
  card.liveError.hidden = false;
}

// The server answers every refusal as {"error": "..."}: show that, it says what to do.
async function refusal(resp) {
  let detail = "";
  try {
    detail = (await resp.json()).error || "";
  } catch (_) {
    // not JSON (a proxy's page): the status alone
  }
  return `live view refused: ${detail || resp.statusText || "no reason given"} (HTTP ${resp.status})`;
}

// The live view is WebRTC over WHEP: fetch() carries the token, which an <img> of the
// MJPEG stream could not; the video element shows the annotated frames as they come.
async function startLive(id, card) {
  card.liveError.hidden = true; // the user acted: a new try
  card.liveError.textContent = "";
  const pc = new RTCPeerConnection();
  card.whep = { pc, location: null };
  card.live.textContent = "Stop live";
  pc.onconnectionstatechange = () => {
    if (pc.connectionState === "failed" && card.whep && card.whep.pc === pc) {
      showLiveError(card, "live view lost: the WebRTC connection failed (is UDP to the server blocked?)");
      stopLive(card);
    }
  };
  pc.addTransceiver("video", { direction: "recvonly" });
  pc.ontrack = (event) => {
    card.video.srcObject = event.streams[0] || new MediaStream([event.track]);
    card.video.hidden = false;
    card.img.hidden = true;
    card.video.play().catch(() => {});
  };
  try {
    await pc.setLocalDescription(await pc.createOffer());
    // Answer with every candidate in the offer: WHEP has no trickle here.
    await new Promise((resolve) => {
      if (pc.iceGatheringState === "complete") return resolve();
      pc.addEventListener("icegatheringstatechange", () => pc.iceGatheringState === "complete" && resolve());
      setTimeout(resolve, 2000);
    });
    const resp = await fetch(`/whep/${encodeURIComponent(id)}`, {
      method: "POST",
      headers: { ...authHeaders, "Content-Type": "application/sdp" },
      body: pc.localDescription.sdp,
    });
    if (card.whep === null || card.whep.pc !== pc) {
      // Stopped while the offer was out: give back a session the server made for it.
      const location = resp.ok && resp.headers.get("Location");
      if (location) fetch(location, { method: "DELETE", headers: authHeaders }).catch(() => {});
      return;
    }
    if (!resp.ok) {
      showLiveError(card, await refusal(resp));
      stopLive(card);
      return;
    }
    card.whep.location = resp.headers.get("Location");
    await pc.setRemoteDescription({ type: "answer", sdp: await resp.text() });
  } catch (err) {
    // fetch() failing (server gone, network down) or a browser refusing the answer.
    if (card.whep && card.whep.pc === pc) {
      showLiveError(card, `live view failed: ${err.message || err}`);
      stopLive(card);
    }
  }
}

function stopLive(card, leaving = false) {
  const session = card.whep;
  card.whep = null;
  card.live.textContent = "Watch live";
  card.video.hidden = true;
  card.video.srcObject = null;
  card.img.hidden = false;
  if (!session) return;
  session.pc.close();
  // keepalive: the DELETE still goes out while the page unloads, so a closed tab gives its
  // session's place back at once instead of holding it until WebRTC finds it gone.
  if (session.location) {
    fetch(session.location, { method: "DELETE", headers: authHeaders, keepalive: leaving }).catch(() => {});
  }
}

window.addEventListener("pagehide", () => {
  for (const card of cards.values()) if (card.whep) stopLive(card, true);
});

function refreshSnapshot(id, card) {
  card.loading = true;
  const url = `/v1/sources/${encodeURIComponent(id)}/snapshot.jpg?t=${Date.now()}`;
  const done = () => { card.loading = false; };
  if (!token) {
    card.img.onload = done;
    card.img.onerror = done;
    card.img.src = url;
    return;
  }
  fetch(url, { headers: authHeaders, cache: "no-store" })
    .then((resp) => (resp.ok ? resp.blob() : null))
    .then((blob) => {
      if (!blob) return done();
      const previous = card.blobUrl;
      card.blobUrl = URL.createObjectURL(blob);
      card.img.onload = () => { if (previous) URL.revokeObjectURL(previous); done(); };
      card.img.onerror = done;
      card.img.src = card.blobUrl;
    })
    .catch(done);
}

function render(sources, stats) {
  const container = document.getElementById("sources");
  const statsById = new Map(stats.sources.map((s) => [s.id, s]));
  const seen = new Set();
  for (const src of sources) {
    seen.add(src.id);
    let card = cards.get(src.id);
    if (!card) {
      card = makeCard(src.id);
      cards.set(src.id, card);
      container.append(card.root);
    }
    const st = statsById.get(src.id) || {};
    const state = card.fields.title.querySelector(".state");
    state.textContent = src.state;
    state.className = "state " + src.state;
    card.fields.reason.textContent = src.reason || "";
    card.fields.overload.textContent = st.overload ? st.overload.message : "";
    card.fields.overload.hidden = !st.overload;
    card.fields.fps.textContent = fmt(st.fps);
    card.fields.p50.textContent = fmt(st.latency_ms && st.latency_ms.p50);
    card.fields.p99.textContent = fmt(st.latency_ms && st.latency_ms.p99);
    card.fields.published.textContent = String(src.published);
    card.fields.dropped.textContent = String(Object.values(src.dropped).reduce((a, b) => a + b, 0));
    card.fields.queue.textContent = String(src.queue_depth);
    // Only ask for a new snapshot when a new frame was published and the last one is in.
    // A count that went down is the same id started again (its count restarts): new frames too.
    if (src.published !== card.shownPublished && !card.loading) {
      card.shownPublished = src.published;
      refreshSnapshot(src.id, card);
    }
  }
  for (const [id, card] of cards) {
    if (!seen.has(id)) {
      if (card.whep) stopLive(card); // its live view ends with the card
      if (card.blobUrl) URL.revokeObjectURL(card.blobUrl);
      card.root.remove();
      cards.delete(id);
    }
  }
  document.getElementById("no-sources").hidden = sources.length > 0;

  const body = document.querySelector("#models tbody");
  body.replaceChildren(
    ...stats.models.map((m) => {
      const row = el("tr");
      row.append(
        el("td", {}, m.model), el("td", {}, String(m.batches)), el("td", {}, fmt(m.mean_batch_size, 2)),
        el("td", {}, fmt(m.queue_ms.p50, 2)), el("td", {}, fmt(m.queue_ms.p99, 2)),
      );
      return row;
    }),
  );
  document.getElementById("models").hidden = stats.models.length === 0;
  document.getElementById("no-models").hidden = stats.models.length > 0;
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const [sources, stats] = await Promise.all([getJson("/v1/sources"), getJson("/v1/stats")]);
    render(sources, stats);
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
    status.classList.remove("error");
  } catch (err) {
    status.textContent = String(err.message || err);
    status.classList.add("error");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
