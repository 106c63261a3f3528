// The CPU process group: separate processes exchanging host tensors over TCP with Gloo, so
// sequence-parallel code runs in CI exactly as it does across GPUs.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "comm/process_group.h"

namespace spindle::comm {

// False when spindle was built without Gloo (libgloo-dev); connect_cpu_world then throws.
bool cpu_communicator_available();

// Collective over all processes of the job: rank 0 hosts the rendezvous store at
// info.master_addr:info.store_port, every rank connects to every other. A single process needs no
// network. GLOO_SOCKET_IFNAME picks the network interface on multi-node jobs. Sets SIGPIPE to
// ignored (unless the program handles it) so a dead peer is an error, not a silent death.
std::unique_ptr<Communicator> connect_cpu_world(const ProcessGroupInfo& info, const CommOptions& options = {});

}  // namespace spindle::comm
