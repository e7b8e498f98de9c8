"""The user's configuration directories in front of the built-in configs (launcher/configs.py).

Hydra's own `--config-dir` and `hydra.searchpath` put a directory after the primary config's,
so a user's preset could never shadow a built-in one of the same name; the launcher's commands
take both off the command line (configs.adopt), with LAUNCHER_CONFIG_PATH, and this plugin
inserts them before the built-in directory each time Hydra builds its search path.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.plugins.search_path_plugin import SearchPathPlugin

from launcher import configs


class UserConfigDirs(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # prepend() inserts before the anchor: each directory lands after the ones before it.
        for path in configs.user_dirs():
            search_path.prepend(
                provider="launcher user configs",
                path=f"file://{path}",
                anchor=SearchPathQuery(provider="main"),
            )
