// The colour theme, set before the page is first drawn (a classic script in <head>, so
// a dark page never flashes light): the "theme" setting (system, light or dark), and
// while it is "system", the system's, followed when it changes. The page's module sends
// "xinfer-theme" when the setting changes.
(function () {
  var root = document.documentElement;
  var dark = window.matchMedia('(prefers-color-scheme: dark)');
  function apply() {
    var theme = 'system';
    try {
      theme = JSON.parse(localStorage.getItem('xinfer.ui.settings.v1') || '{}').theme || 'system';
    } catch (e) {
      theme = 'system';
    }
    root.dataset.theme = theme === 'light' || theme === 'dark' ? theme : dark.matches ? 'dark' : 'light';
  }
  apply();
  dark.addEventListener('change', apply);
  window.addEventListener('xinfer-theme', apply);
  window.addEventListener('storage', apply);
})();
