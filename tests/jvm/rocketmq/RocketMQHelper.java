// A RocketMQ client for the tests, written against RocketMQ's own Java client so that what a real
// broker wrote to its commitlog can be compared with what tierlog read from it.  tests/rocketmq.py
// compiles it with javac at the first use and runs it; it prints JSON lines only.
//
//   send NAMESRV SPEC_JSON    sends the workload of SPEC_JSON (see tests/rocketmq.py) and prints one
//                             line per message the broker accepted: the sender's ledger
//   fail NAMESRV GROUP TOPIC N MAX_RECONSUME
//                             a push consumer that fails the first N messages of TOPIC every time,
//                             so the broker moves them to %RETRY%GROUP and then %DLQ%GROUP; it
//                             prints one line per delivery and ends once each failed N times + 1
//   topics NAMESRV BROKER_ADDR TOPIC:QUEUES...
//                             creates the topics on the broker and waits until the name server
//                             routes each of them
//   read NAMESRV TOPIC...     every message the broker serves for each TOPIC, through its consume
//                             path, queue by queue from the lowest offset it holds
import com.alibaba.fastjson2.JSON;
import com.alibaba.fastjson2.JSONArray;
import com.alibaba.fastjson2.JSONObject;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.Base64;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Random;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import org.apache.rocketmq.client.consumer.DefaultMQPullConsumer;
import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.PullResult;
import org.apache.rocketmq.client.consumer.PullStatus;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.LocalTransactionState;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.SendStatus;
import org.apache.rocketmq.client.producer.TransactionListener;
import org.apache.rocketmq.client.producer.TransactionMQProducer;
import org.apache.rocketmq.client.producer.TransactionSendResult;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageExt;
import org.apache.rocketmq.common.message.MessageQueue;

public final class RocketMQHelper {
    private RocketMQHelper() {}

    // The client's logging prints its set-up to System.out; only our JSON lines go there.
    static final java.io.PrintStream OUT = System.out;

    public static void main(String[] args) throws Exception {
        System.setOut(System.err);
        // A consumer learns a new retry topic's queues at its next rebalance (20 s by default).
        System.setProperty("rocketmq.client.rebalance.waitInterval", "500");
        switch (args[0]) {
            case "send": send(args[1], JSON.parseObject(args[2])); break;
            case "fail": fail(args[1], args[2], args[3], Integer.parseInt(args[4]), Integer.parseInt(args[5])); break;
            case "topics": topics(args[1], args[2], java.util.Arrays.copyOfRange(args, 3, args.length)); break;
            case "read": for (int i = 2; i < args.length; i++) read(args[1], args[i]); break;
            default: throw new IllegalArgumentException("unknown command " + args[0]);
        }
        OUT.flush();
        System.exit(0);  // the client's threads are not daemons
    }

    /** Requests to the name server and the broker wait up to 30 s, not the client's 3: a test's
     *  JVMs share two cores with Spark drivers and other brokers, and how fast they answer is not
     *  what the tests check.  A transaction producer's sends too. */
    static void patient(org.apache.rocketmq.client.ClientConfig client) {
        client.setMqClientApiTimeout(30_000);
        if (client instanceof DefaultMQProducer) {
            ((DefaultMQProducer) client).setSendMsgTimeout(Math.max(10_000, ((DefaultMQProducer) client).getSendMsgTimeout()));
        }
    }

    // ---- send -------------------------------------------------------------------------------

    static void send(String namesrv, JSONObject spec) throws Exception {
        String group = "tierlog-tests-" + spec.getIntValue("seed");
        DefaultMQProducer producer = new DefaultMQProducer(group + "-producer");
        producer.setNamesrvAddr(namesrv);
        patient(producer);
        producer.setDefaultTopicQueueNums(spec.getIntValue("queues"));
        producer.setMaxMessageSize(4 * 1024 * 1024);
        producer.setSendMsgTimeout(10_000);
        producer.start();
        Random random = new Random(spec.getLongValue("seed"));
        JSONArray topics = spec.getJSONArray("topics");
        int keys = spec.getIntValue("keys");
        try {
            for (int i = 0; i < spec.getIntValue("messages"); i++) {
                String topic = topics.getString(i % topics.size());
                Message m = new Message(topic, "tag" + (i % 3), ("k" + random.nextInt(keys)),
                                        ("body " + i + " " + randomText(random, 20 + random.nextInt(300))).getBytes(StandardCharsets.UTF_8));
                m.putUserProperty("seq", Integer.toString(i));
                ledger("normal", m, sendRouted(producer, m));
            }
            String topic = topics.getString(0);
            for (int b = 0; b < spec.getIntValue("batches"); b++) {
                List<Message> batch = new ArrayList<>();
                for (int j = 0; j < 10; j++) {
                    batch.add(new Message(topic, "batch", "b" + b + "-" + j, ("batch " + b + " " + j).getBytes(StandardCharsets.UTF_8)));
                }
                SendResult result = producer.send(batch);
                // A batch goes to one queue, at consecutive offsets from the one the result names.
                for (int j = 0; j < batch.size(); j++) ledgerAt("batch", batch.get(j), result, j);
            }
            for (int d = 0; d < spec.getIntValue("delayed"); d++) {
                Message level = new Message(topic, "delayed", "d" + d, ("delay level " + d).getBytes(StandardCharsets.UTF_8));
                level.setDelayTimeLevel(1 + d % 2);
                ledger("delay_level", level, sendRouted(producer, level));
                Message timer = new Message(topic, "timer", "t" + d, ("timer " + d).getBytes(StandardCharsets.UTF_8));
                timer.setDeliverTimeMs(System.currentTimeMillis() + 1000 + 200L * d);
                ledger("timer", timer, sendRouted(producer, timer));
            }
            for (int l = 0; l < spec.getIntValue("large"); l++) {
                // One that zlib shrinks and one it cannot: both carry the client's compressed flag.
                byte[] text = randomText(random, 200_000).getBytes(StandardCharsets.UTF_8);
                byte[] noise = new byte[300_000];
                random.nextBytes(noise);
                Message a = new Message(topic, "large", "L" + l, text);
                ledger("large", a, sendRouted(producer, a));
                Message b = new Message(topic, "large", "N" + l, noise);
                ledger("large", b, sendRouted(producer, b));
            }
        } finally {
            producer.shutdown();
        }
        int transactions = spec.getIntValue("transactions");
        if (transactions > 0) sendTransactions(namesrv, group, topics.getString(topics.size() - 1), transactions);
    }

    // A broker that just (re)started may not be routed by the name server yet: it registers after
    // "boot success".  Every other failure is the test's to see.
    static SendResult sendRouted(DefaultMQProducer producer, Message m) throws Exception {
        long deadline = System.currentTimeMillis() + 60_000;
        while (true) {
            try {
                return producer.send(m);
            } catch (org.apache.rocketmq.client.exception.MQClientException e) {
                if (!String.valueOf(e.getMessage()).contains("No route info") || System.currentTimeMillis() > deadline) throw e;
                Thread.sleep(200);
            }
        }
    }

    static void sendTransactions(String namesrv, String group, String topic, int n) throws Exception {
        Map<String, LocalTransactionState> decided = new ConcurrentHashMap<>();
        TransactionMQProducer producer = new TransactionMQProducer(group + "-tx");
        producer.setNamesrvAddr(namesrv);
        patient(producer);
        producer.setTransactionListener(new TransactionListener() {
            @Override
            public LocalTransactionState executeLocalTransaction(Message msg, Object arg) {
                LocalTransactionState state = (Integer) arg % 2 == 0 ? LocalTransactionState.COMMIT_MESSAGE : LocalTransactionState.ROLLBACK_MESSAGE;
                decided.put(msg.getKeys(), state);
                return state;
            }

            @Override
            public LocalTransactionState checkLocalTransaction(MessageExt msg) {
                return decided.getOrDefault(msg.getKeys(), LocalTransactionState.ROLLBACK_MESSAGE);
            }
        });
        producer.start();
        try {
            for (int i = 0; i < n; i++) {
                Message m = new Message(topic, "tx", "tx" + i, ("transaction " + i).getBytes(StandardCharsets.UTF_8));
                TransactionSendResult result = producer.sendMessageInTransaction(m, i);
                JSONObject line = new JSONObject();
                line.put("kind", result.getLocalTransactionState() == LocalTransactionState.COMMIT_MESSAGE ? "tx_commit" : "tx_rollback");
                line.put("topic", topic);
                line.put("key", m.getKeys());
                line.put("msg_id", result.getMsgId());
                line.put("body_sha256", sha256(m.getBody()));
                OUT.println(line.toJSONString());
            }
        } finally {
            producer.shutdown();
        }
    }

    static void ledger(String kind, Message m, SendResult result) throws Exception {
        ledgerAt(kind, m, result, 0);
    }

    static void ledgerAt(String kind, Message m, SendResult result, int index) throws Exception {
        if (result.getSendStatus() != SendStatus.SEND_OK) {
            throw new IllegalStateException("send of " + m.getKeys() + " returned " + result.getSendStatus());
        }
        JSONObject line = new JSONObject();
        line.put("kind", kind);
        line.put("topic", m.getTopic());
        line.put("queue_id", result.getMessageQueue().getQueueId());
        // A delayed message is written first to a system topic; its queue offset there is not the
        // one it will have in its own topic, so only the others' offsets are the ledger's to check.
        if (!kind.equals("delay_level") && !kind.equals("timer")) line.put("queue_offset", result.getQueueOffset() + index);
        line.put("key", m.getKeys());
        // A batch's result joins its ids with commas; each message carries its own.
        line.put("msg_id", kind.equals("batch") ? m.getProperty("UNIQ_KEY") : result.getMsgId());
        line.put("body_sha256", sha256(m.getBody()));
        line.put("body_len", m.getBody().length);
        OUT.println(line.toJSONString());
    }

    // ---- topics -----------------------------------------------------------------------------

    static void topics(String namesrv, String brokerAddr, String[] specs) throws Exception {
        org.apache.rocketmq.tools.admin.DefaultMQAdminExt admin = new org.apache.rocketmq.tools.admin.DefaultMQAdminExt(30_000);
        admin.setNamesrvAddr(namesrv);
        patient(admin);
        admin.start();
        try {
            for (String spec : specs) {
                String[] parts = spec.split(":");
                org.apache.rocketmq.common.TopicConfig config = new org.apache.rocketmq.common.TopicConfig(parts[0]);
                config.setReadQueueNums(Integer.parseInt(parts[1]));
                config.setWriteQueueNums(Integer.parseInt(parts[1]));
                admin.createAndUpdateTopicConfig(brokerAddr, config);
            }
            long deadline = System.currentTimeMillis() + 60_000;
            for (String spec : specs) {
                String topic = spec.split(":")[0];
                while (true) {
                    try {
                        if (!admin.examineTopicRouteInfo(topic).getQueueDatas().isEmpty()) break;
                    } catch (Exception notYet) {
                        if (System.currentTimeMillis() > deadline) throw notYet;
                    }
                    Thread.sleep(100);
                }
            }
        } finally {
            admin.shutdown();
        }
    }

    // ---- fail -------------------------------------------------------------------------------

    static void fail(String namesrv, String group, String topic, int n, int maxReconsume) throws Exception {
        Map<String, Integer> deliveries = new ConcurrentHashMap<>();
        Set<String> failing = ConcurrentHashMap.newKeySet();
        CountDownLatch done = new CountDownLatch(n);
        DefaultMQPushConsumer consumer = new DefaultMQPushConsumer(group);
        consumer.setNamesrvAddr(namesrv);
        patient(consumer);
        consumer.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        consumer.setMaxReconsumeTimes(maxReconsume);
        consumer.setPollNameServerInterval(500);  // routes of the retry topic it makes, soon
        consumer.setConsumeMessageBatchMaxSize(1);
        consumer.subscribe(topic, "*");
        consumer.registerMessageListener((MessageListenerConcurrently) (msgs, context) -> {
            MessageExt m = msgs.get(0);
            String id = m.getMsgId();
            synchronized (failing) {
                if (!failing.contains(id) && failing.size() < n && m.getReconsumeTimes() == 0) failing.add(id);
            }
            if (!failing.contains(id)) return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
            int times = deliveries.merge(id, 1, Integer::sum);
            JSONObject line = new JSONObject();
            line.put("msg_id", id);
            line.put("reconsume_times", m.getReconsumeTimes());
            synchronized (OUT) { OUT.println(line.toJSONString()); }
            if (times == maxReconsume + 1) done.countDown();
            return ConsumeConcurrentlyStatus.RECONSUME_LATER;
        });
        consumer.start();
        try {
            if (!done.await(120, TimeUnit.SECONDS)) throw new IllegalStateException("retries did not finish: " + deliveries);
        } finally {
            consumer.shutdown();
        }
    }

    // ---- read -------------------------------------------------------------------------------

    @SuppressWarnings("deprecation")
    static void read(String namesrv, String topic) throws Exception {
        DefaultMQPullConsumer consumer = new DefaultMQPullConsumer("tierlog-tests-reader");
        consumer.setNamesrvAddr(namesrv);
        patient(consumer);
        consumer.start();
        try {
            for (MessageQueue mq : consumer.fetchSubscribeMessageQueues(topic)) {
                long offset = consumer.minOffset(mq);
                long max = consumer.maxOffset(mq);
                while (offset < max) {
                    PullResult result = consumer.pull(mq, "*", offset, 32);
                    if (result.getPullStatus() != PullStatus.FOUND) {
                        throw new IllegalStateException(mq + " at " + offset + " of " + max + ": " + result.getPullStatus());
                    }
                    for (MessageExt m : result.getMsgFoundList()) printMessage(m);
                    offset = result.getNextBeginOffset();
                }
            }
        } finally {
            consumer.shutdown();
        }
    }

    static void printMessage(MessageExt m) {
        JSONObject line = new JSONObject();
        line.put("topic", m.getTopic());
        line.put("queue_id", m.getQueueId());
        line.put("queue_offset", m.getQueueOffset());
        line.put("phy_offset", m.getCommitLogOffset());
        line.put("msg_id", m.getMsgId());
        line.put("key", m.getKeys());
        line.put("tags", m.getTags());
        line.put("body", Base64.getEncoder().encodeToString(m.getBody()));
        line.put("store_ts", m.getStoreTimestamp());
        line.put("born_ts", m.getBornTimestamp());
        line.put("sysflag", m.getSysFlag());
        line.put("reconsume_times", m.getReconsumeTimes());
        line.put("properties", new LinkedHashMap<>(m.getProperties()));
        OUT.println(line.toJSONString());
    }

    // ---- helpers ----------------------------------------------------------------------------

    static String randomText(Random random, int n) {
        StringBuilder sb = new StringBuilder(n);
        String words = "abcdefghij klmnop qrstuv wxyz ";
        for (int i = 0; i < n; i++) sb.append(words.charAt(random.nextInt(words.length())));
        return sb.toString();
    }

    static String sha256(byte[] data) throws Exception {
        StringBuilder sb = new StringBuilder();
        for (byte b : MessageDigest.getInstance("SHA-256").digest(data)) sb.append(String.format("%02x", b));
        return sb.toString();
    }
}
