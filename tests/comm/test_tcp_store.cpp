#include <gtest/gtest.h>

#include <thread>

#include "comm/tcp_store.h"
#include "core/error.h"
#include "launch/launcher.h"

namespace spindle::comm {
namespace {

std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(TcpStore, SetGetAddAcrossClients) {
  const int port = pick_free_port();
  TcpStore server("127.0.0.1", port, true, std::chrono::seconds(10));
  TcpStore client("127.0.0.1", port, false, std::chrono::seconds(10));
  server.set("a", bytes("alpha"));
  EXPECT_EQ(client.get("a"), bytes("alpha"));
  client.set("a", bytes(""));  // overwrite with an empty value
  EXPECT_EQ(server.get("a"), bytes(""));
  EXPECT_EQ(client.add("n", 5), 5);
  EXPECT_EQ(server.add("n", -2), 3);
}

TEST(TcpStore, GetWaitsForALaterSet) {
  const int port = pick_free_port();
  TcpStore server("127.0.0.1", port, true, std::chrono::seconds(10));
  std::thread writer([port] {
    TcpStore late("localhost", port, false, std::chrono::seconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    late.set("id", bytes("nccl-unique-id"));
  });
  TcpStore reader("127.0.0.1", port, false, std::chrono::seconds(10));
  EXPECT_EQ(reader.get("id"), bytes("nccl-unique-id"));
  writer.join();
}

TEST(TcpStore, ConcurrentAddsAreAtomic) {
  const int port = pick_free_port();
  TcpStore server("127.0.0.1", port, true, std::chrono::seconds(10));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([port] {
      TcpStore client("127.0.0.1", port, false, std::chrono::seconds(10));
      for (int i = 0; i < 50; ++i) client.add("count", 1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(server.add("count", 0), 200);
}

TEST(TcpStore, ClientWaitsForAServerThatStartsLate) {
  const int port = pick_free_port();
  std::unique_ptr<TcpStore> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    server = std::make_unique<TcpStore>("127.0.0.1", port, true, std::chrono::seconds(10));
    server->set("ready", bytes("yes"));
  });
  TcpStore client("127.0.0.1", port, false, std::chrono::seconds(10));
  EXPECT_EQ(client.get("ready"), bytes("yes"));
  starter.join();
}

TEST(TcpStore, ErrorsSayWhatToChange) {
  const int port = pick_free_port();
  TcpStore server("127.0.0.1", port, true, std::chrono::seconds(10));
  try {
    server.get("never", std::chrono::milliseconds(200));
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              fmt::format("rendezvous store: timed out after 0.2 s waiting for key 'never' at 127.0.0.1:{}; another "
                          "rank did not arrive (did it fail to start or crash?)",
                          port));
  }
  // The socket recovers after a timeout.
  server.set("k", bytes("v"));
  EXPECT_EQ(server.get("k"), bytes("v"));
  try {
    TcpStore second("127.0.0.1", port, true, std::chrono::seconds(1));
    FAIL() << "bound twice";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              fmt::format("rendezvous store: port {} is already in use on this machine (rank 0 hosts the store there); "
                          "set MASTER_PORT (or SPINDLE_STORE_PORT) to a free port",
                          port));
  }
  const int closed_port = pick_free_port();
  try {
    TcpStore nobody("127.0.0.1", closed_port, false, std::chrono::milliseconds(300));
    FAIL() << "connected to nobody";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("could not reach 127.0.0.1:{} within 0.3 s", closed_port)),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace spindle::comm
