#include "common/systemd_notify.h"

#include <systemd/sd-daemon.h>

#include <cstdlib>

namespace hmoe {

void NotifySystemd(const std::string& state) { sd_notify(0, state.c_str()); }

bool SystemdNotifySocketSet() {
  const char* s = std::getenv("NOTIFY_SOCKET");
  return s != nullptr && *s != '\0';
}

}  // namespace hmoe
