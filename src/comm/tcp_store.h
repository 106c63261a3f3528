// A small TCP key-value store for rendezvous: processes of one job exchange the addresses they
// listen on (Gloo) or a unique id (NCCL) through it before any collective exists. Rank 0 hosts
// the server on MASTER_ADDR:port; every rank (rank 0 included) talks to it as a client.
// No Debian package offers a stand-alone one (Gloo brings only file, hash and Redis stores).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace spindle::comm {

// A TCP socket bound to `port` on every address of this machine, as the store's server binds it:
// IPv6 dual-stack (IPv4 clients reach it too), IPv4 where IPv6 is unavailable; SO_REUSEADDR; not
// listening yet. Port 0 lets the kernel choose. Returns the descriptor, or -1 with errno set
// (EADDRINUSE: the port is taken).
int bind_any_address(int port);

class TcpStoreServer;

class TcpStore {
 public:
  // host_server: this process runs the server (bound to all interfaces on `port`).
  // Clients retry the connection until `timeout`, so ranks may start in any order.
  TcpStore(std::string host, int port, bool host_server, std::chrono::milliseconds timeout);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::vector<char>& value);
  // Blocks until the key exists (or the timeout passes: spindle::Error naming the key).
  std::vector<char> get(const std::string& key);
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout);
  // Atomically adds delta to the integer stored at key (0 when absent); returns the new value.
  int64_t add(const std::string& key, int64_t delta);

  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  std::vector<char> request(uint8_t op, const std::string& key, const std::vector<char>& value,
                            std::chrono::milliseconds timeout);
  void connect_to_server();

  std::string host_;
  int port_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mutex_;  // one request at a time on the socket
  int socket_ = -1;
};

}  // namespace spindle::comm
