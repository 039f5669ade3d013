// The one sender of service-manager notifications (sd_notify(3)): READY=1,
// STATUS=..., STOPPING=1. Every binary that tells systemd something goes
// through here.
#pragma once

#include <string>

namespace hmoe {

// Sends `state` (newline-separated VAR=value assignments) to the socket named
// by $NOTIFY_SOCKET, read at each call; nothing when it is unset. Failures are
// ignored (a notification is advice to the manager, never a reason to stop).
void NotifySystemd(const std::string& state);

// Whether $NOTIFY_SOCKET is set (a service manager listens).
bool SystemdNotifySocketSet();

}  // namespace hmoe
