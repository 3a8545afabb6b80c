// Only in a page served by `harbor-async view`: poll the server's version of
// the job and reload when a new episode has finished. The URL's hash keeps the
// filters and the open episode across the reload.
(() => {
  "use strict";
  const mine = document.body.dataset.version;
  const every = 3000;
  async function poll() {
    try {
      const answer = await fetch("__version", { cache: "no-store" });
      if (answer.ok) {
        const version = (await answer.text()).trim();
        if (version && version !== mine) { location.reload(); return; }
      }
    } catch (err) {
      // The server is gone (view was stopped): keep the page as it is, try again later.
    }
    setTimeout(poll, every);
  }
  setTimeout(poll, every);
})();
