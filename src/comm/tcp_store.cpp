#include "comm/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

#include "core/error.h"

namespace spindle::comm {

namespace {

// Wire format, both directions little-endian host order (all peers run the same binary):
// request = op u8 | key_len u32 | key | value_len u32 | value;  reply = value_len u32 | value.
constexpr uint8_t kSet = 1, kGet = 2, kAdd = 3;
constexpr size_t kMaxMessage = 64u << 20;  // addresses and ids are tiny; this catches garbage

using Clock = std::chrono::steady_clock;

std::string errno_text() { return std::strerror(errno); }

void append_u32(std::vector<char>& out, uint32_t v) {
  const char* p = reinterpret_cast<const char*>(&v);
  out.insert(out.end(), p, p + 4);
}
uint32_t read_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Writes everything or throws; the peer is on the same job, so a short blocking write is fine.
void write_all(int fd, const char* data, size_t size, const std::string& what) {
  while (size > 0) {
    ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("rendezvous store: {} failed: {}", what, errno_text());
    data += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace

// ---- server ------------------------------------------------------------------------------------

int bind_any_address(int port) {
  int last_errno = EAFNOSUPPORT;
  for (int family : {AF_INET6, AF_INET}) {
    int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    int one = 1, zero = 0;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_storage address{};
    socklen_t length;
    if (family == AF_INET6) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      auto* a = reinterpret_cast<sockaddr_in6*>(&address);
      a->sin6_family = AF_INET6;
      a->sin6_addr = in6addr_any;
      a->sin6_port = htons(static_cast<uint16_t>(port));
      length = sizeof(sockaddr_in6);
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&address);
      a->sin_family = AF_INET;
      a->sin_addr.s_addr = htonl(INADDR_ANY);
      a->sin_port = htons(static_cast<uint16_t>(port));
      length = sizeof(sockaddr_in);
    }
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), length) == 0) return fd;
    last_errno = errno;
    ::close(fd);
    if (last_errno == EADDRINUSE) break;  // taken: the other family would not help
  }
  errno = last_errno;
  return -1;
}

class TcpStoreServer {
 public:
  explicit TcpStoreServer(int port) {
    listen_fd_ = bind_listener(port);
    if (::pipe2(wake_pipe_, O_CLOEXEC) != 0) fail("rendezvous store: pipe failed: {}", errno_text());
    thread_ = std::thread([this] { serve(); });
  }
  ~TcpStoreServer() {
    char byte = 0;
    (void)!::write(wake_pipe_[1], &byte, 1);
    thread_.join();
    for (auto& [fd, client] : clients_) ::close(fd);
    ::close(listen_fd_);
    ::close(wake_pipe_[0]);
    ::close(wake_pipe_[1]);
  }

 private:
  struct Client {
    std::vector<char> pending;  // bytes of a request not yet complete
  };

  static int bind_listener(int port) {
    const int fd = bind_any_address(port);
    if (fd < 0 && errno == EADDRINUSE)
      fail("rendezvous store: port {} is already in use on this machine (rank 0 hosts the store there); "
           "set MASTER_PORT (or SPINDLE_STORE_PORT) to a free port",
           port);
    if (fd < 0 || ::listen(fd, 1024) != 0) {
      const std::string why = errno_text();
      if (fd >= 0) ::close(fd);
      fail("rendezvous store: cannot listen on port {}: {}", port, why);
    }
    return fd;
  }

  void serve() {
    for (;;) {
      std::vector<pollfd> fds{{wake_pipe_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
      for (auto& [fd, client] : clients_) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents) return;
      if (fds[1].revents & POLLIN) {
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) {
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          clients_[fd] = Client{};
        }
      }
      for (size_t i = 2; i < fds.size(); ++i)
        if (fds[i].revents) read_from(fds[i].fd);
    }
  }

  void drop(int fd) {
    for (auto& [key, waiters] : waiting_) std::erase(waiters, fd);
    clients_.erase(fd);
    ::close(fd);
  }

  void read_from(int fd) {
    if (!clients_.contains(fd)) return;  // dropped earlier in this round
    char buffer[65536];
    ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) return;
      drop(fd);
      return;
    }
    auto& pending = clients_[fd].pending;
    pending.insert(pending.end(), buffer, buffer + n);
    // Handle every complete request in the buffer.
    for (;;) {
      if (pending.size() < 5) return;
      uint32_t key_length = read_u32(pending.data() + 1);
      if (key_length > kMaxMessage) return drop(fd);
      if (pending.size() < 5 + key_length + 4) return;
      uint32_t value_length = read_u32(pending.data() + 5 + key_length);
      if (value_length > kMaxMessage) return drop(fd);
      size_t total = 5 + key_length + 4 + value_length;
      if (pending.size() < total) return;
      uint8_t op = static_cast<uint8_t>(pending[0]);
      std::string key(pending.data() + 5, key_length);
      std::vector<char> value(pending.begin() + 5 + key_length + 4, pending.begin() + total);
      pending.erase(pending.begin(), pending.begin() + total);
      if (!handle(fd, op, key, std::move(value))) return drop(fd);
    }
  }

  bool reply(int fd, const std::vector<char>& value) {
    std::vector<char> message;
    append_u32(message, static_cast<uint32_t>(value.size()));
    message.insert(message.end(), value.begin(), value.end());
    try {
      write_all(fd, message.data(), message.size(), "reply");
    } catch (const Error&) {
      return false;  // that client went away; the others carry on
    }
    return true;
  }

  bool handle(int fd, uint8_t op, const std::string& key, std::vector<char> value) {
    switch (op) {
      case kSet: {
        data_[key] = value;
        auto waiters = std::move(waiting_[key]);
        waiting_.erase(key);
        for (int waiter : waiters)
          if (waiter != fd && !reply(waiter, value)) drop(waiter);
        return reply(fd, {});
      }
      case kGet: {
        auto it = data_.find(key);
        if (it != data_.end()) return reply(fd, it->second);
        waiting_[key].push_back(fd);  // answered by the set that creates the key
        return true;
      }
      case kAdd: {
        if (value.size() != 8) return false;
        int64_t delta, current = 0;
        std::memcpy(&delta, value.data(), 8);
        auto it = data_.find(key);
        if (it != data_.end() && it->second.size() == 8) std::memcpy(&current, it->second.data(), 8);
        current += delta;
        std::vector<char> stored(8);
        std::memcpy(stored.data(), &current, 8);
        data_[key] = stored;
        return reply(fd, stored);
      }
      default:
        return false;
    }
  }

  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  std::thread thread_;
  std::map<int, Client> clients_;
  std::map<std::string, std::vector<char>> data_;
  std::map<std::string, std::vector<int>> waiting_;
};

// ---- client ------------------------------------------------------------------------------------

TcpStore::TcpStore(std::string host, int port, bool host_server, std::chrono::milliseconds timeout)
    : host_(std::move(host)), port_(port), timeout_(timeout) {
  if (port <= 0 || port > 65535) fail("rendezvous store: port {} is not a TCP port (1-65535)", port);
  if (host_server) server_ = std::make_unique<TcpStoreServer>(port);
  connect_to_server();
}

TcpStore::~TcpStore() {
  if (socket_ >= 0) ::close(socket_);
}

void TcpStore::connect_to_server() {
  auto deadline = Clock::now() + timeout_;
  std::string last_error;
  auto backoff = std::chrono::milliseconds(10);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    std::string port_text = std::to_string(port_);
    int rc = ::getaddrinfo(host_.c_str(), port_text.c_str(), &hints, &found);
    if (rc != 0) {
      last_error = ::gai_strerror(rc);
    } else {
      for (addrinfo* a = found; a; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          socket_ = fd;
          ::freeaddrinfo(found);
          return;
        }
        last_error = errno_text();
        ::close(fd);
      }
      ::freeaddrinfo(found);
    }
    if (Clock::now() + backoff > deadline)
      fail("rendezvous store: could not reach {}:{} within {} s ({}); check MASTER_ADDR/MASTER_PORT and that "
           "rank 0 started",
           host_, port_, timeout_.count() / 1000.0, last_error);
    // Rank 0 may not have bound the port yet: retry with a growing pause, not a spin.
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

std::vector<char> TcpStore::request(uint8_t op, const std::string& key, const std::vector<char>& value,
                                    std::chrono::milliseconds timeout) {
  std::lock_guard lock(mutex_);
  if (socket_ < 0) connect_to_server();
  std::vector<char> message{static_cast<char>(op)};
  append_u32(message, static_cast<uint32_t>(key.size()));
  message.insert(message.end(), key.begin(), key.end());
  append_u32(message, static_cast<uint32_t>(value.size()));
  message.insert(message.end(), value.begin(), value.end());
  write_all(socket_, message.data(), message.size(), "request '" + key + "'");

  auto deadline = Clock::now() + timeout;
  std::vector<char> received;
  auto read_exactly = [&](size_t count) {
    while (received.size() < count) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pollfd p{socket_, POLLIN, 0};
      int ready = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) {
        // A late reply would desynchronise this socket: start over on the next request.
        ::close(socket_);
        socket_ = -1;
        fail("rendezvous store: timed out after {} s waiting for key '{}' at {}:{}; another rank did not "
             "arrive (did it fail to start or crash?)",
             timeout.count() / 1000.0, key, host_, port_);
      }
      char buffer[65536];
      ssize_t n = ::recv(socket_, buffer, std::min(sizeof buffer, count - received.size()), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        ::close(socket_);
        socket_ = -1;
        fail("rendezvous store: lost the connection to {}:{} (rank 0, which hosts the store, probably exited)",
             host_, port_);
      }
      received.insert(received.end(), buffer, buffer + n);
    }
  };
  read_exactly(4);
  uint32_t length = read_u32(received.data());
  if (length > kMaxMessage) fail("rendezvous store: malformed reply from {}:{}", host_, port_);
  read_exactly(4 + length);
  return {received.begin() + 4, received.end()};
}

void TcpStore::set(const std::string& key, const std::vector<char>& value) { request(kSet, key, value, timeout_); }

std::vector<char> TcpStore::get(const std::string& key) { return get(key, timeout_); }

std::vector<char> TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return request(kGet, key, {}, timeout);
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::vector<char> value(8);
  std::memcpy(value.data(), &delta, 8);
  auto reply = request(kAdd, key, value, timeout_);
  if (reply.size() != 8) fail("rendezvous store: malformed reply to add('{}')", key);
  int64_t result;
  std::memcpy(&result, reply.data(), 8);
  return result;
}

}  // namespace spindle::comm
