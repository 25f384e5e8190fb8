// runstile dashboard: times in the viewer's zone (UTC stays on hover), live statuses,
// and a confirmation before a discard.  Every page reads the same without this file.
(function () {
  "use strict";
  var POLL_MS = 1500;
  // A finished run only gains delivery events: its page polls more slowly.
  var SETTLED_POLL_MS = 5000;
  var TERMINAL = ["completed", "failed", "cancelled", "interrupted"];

  function localTimes(root) {
    var fmt = new Intl.DateTimeFormat(undefined, {
      year: "numeric", month: "short", day: "2-digit",
      hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false,
      timeZoneName: "short"
    });
    root.querySelectorAll("time[datetime]").forEach(function (el) {
      var when = new Date(el.getAttribute("datetime"));
      if (!isNaN(when)) { el.textContent = fmt.format(when); }
    });
  }

  function setStatus(badge, status) {
    if (badge.getAttribute("data-status") === status) { return; }
    badge.className = "status status-" + status;
    badge.setAttribute("data-status", status);
    badge.textContent = status.replace(/_/g, " ");
  }

  function getJSON(url) {
    return fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) {
        if (r.status === 401) { window.location.reload(); throw new Error("signed out"); }
        if (!r.ok) { throw new Error("HTTP " + r.status); }
        return r.json();
      });
  }

  // No polling while the tab is hidden; the first tick after it shows again catches up.
  function schedule(fn, ms) {
    window.setTimeout(function () {
      if (document.hidden) {
        document.addEventListener("visibilitychange", function once() {
          document.removeEventListener("visibilitychange", once);
          fn();
        });
      } else { fn(); }
    }, ms || POLL_MS);
  }

  // Runs page: poll the statuses of the rows on screen that have not finished, and
  // repaint their badges; a finished run's status never changes again.
  function liveRuns() {
    var rows = Array.prototype.slice.call(document.querySelectorAll("[data-testid='run-row']"));
    function going() {
      return rows.filter(function (row) {
        var badge = row.querySelector("[data-testid='run-status']");
        return badge && TERMINAL.indexOf(badge.getAttribute("data-status")) < 0;
      });
    }
    function tick() {
      var watched = going();
      if (!watched.length) { return; }
      var query = watched.map(function (row) {
        return "id=" + encodeURIComponent(row.getAttribute("data-run-id"));
      }).join("&");
      getJSON("/ui/live/statuses?" + query).then(function (body) {
        watched.forEach(function (row) {
          var run = body.runs[row.getAttribute("data-run-id")];
          var badge = row.querySelector("[data-testid='run-status']");
          if (run && badge) { setStatus(badge, run.status); }
        });
      }).catch(function () {}).then(function () { schedule(tick); });
    }
    schedule(tick);
  }

  // Run page: when the run moved (status, last change, new events), fetch the page
  // again and swap its main part in place: no reload, and the buttons follow the status.
  function liveRun() {
    var body = document.body, runId = body.getAttribute("data-run-id");
    function tick() {
      var url = "/ui/live/runs/" + encodeURIComponent(runId) + "?after=" +
        encodeURIComponent(body.getAttribute("data-last-seq") || "0");
      getJSON(url).then(function (run) {
        var moved = run.newer_events || run.status !== body.getAttribute("data-status") ||
          run.updated_at !== body.getAttribute("data-updated");
        return moved ? redraw() : null;
      }).catch(function () {}).then(function () {
        var settled = TERMINAL.indexOf(body.getAttribute("data-status")) >= 0;
        schedule(tick, settled ? SETTLED_POLL_MS : POLL_MS);
      });
    }
    schedule(tick);
  }

  function redraw() {
    return fetch(window.location.href, { credentials: "same-origin" }).then(function (r) {
      if (!r.ok) { throw new Error("HTTP " + r.status); }
      return r.text();
    }).then(function (html) {
      var next = new DOMParser().parseFromString(html, "text/html");
      var main = next.getElementById("main");
      if (!main || next.body.getAttribute("data-page") !== "run") { window.location.reload(); return; }
      ["data-status", "data-updated", "data-last-seq"].forEach(function (name) {
        document.body.setAttribute(name, next.body.getAttribute(name));
      });
      // Keep open whatever the reader unfolded.
      var open = Array.prototype.map.call(document.querySelectorAll("#main details[open] summary"),
        function (s) { return s.textContent; });
      var current = document.getElementById("main");
      var notices = current.querySelectorAll("[data-testid='notice']");
      main.querySelectorAll("[data-testid='notice']").forEach(function (n) { n.remove(); });
      Array.prototype.slice.call(notices).reverse().forEach(function (n) { main.prepend(n); });
      current.replaceWith(main);
      main.querySelectorAll("details summary").forEach(function (s) {
        if (open.indexOf(s.textContent) >= 0) { s.parentNode.open = true; }
      });
      decorate(main);
    });
  }

  function decorate(root) {
    localTimes(root);
    root.querySelectorAll("form[data-confirm]").forEach(function (form) {
      form.addEventListener("submit", function (e) {
        if (!window.confirm(form.getAttribute("data-confirm"))) { e.preventDefault(); }
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    decorate(document);
    var page = document.body.getAttribute("data-page");
    if (page === "runs") { liveRuns(); }
    if (page === "run") { liveRun(); }
  });
}());
